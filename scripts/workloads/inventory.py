"""A small inventory of a shop: items, stock levels, orders and a report (the code-edit workload's file)."""

import csv
import json
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

LOW_STOCK = 5
TAX_RATE = 0.2


@dataclass
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0
    tags: list[str] = field(default_factory=list)

    def value(self) -> float:
        """What the items in stock are worth."""
        return self.price * self.quantity

    def is_low(self) -> bool:
        """Whether the stock has fallen to the reorder level."""
        return self.quantity <= LOW_STOCK


@dataclass
class OrderLine:
    sku: str
    quantity: int


@dataclass
class Order:
    number: int
    customer: str
    lines: list[OrderLine]
    day: date = field(default_factory=date.today)


class Inventory:
    def __init__(self):
        self.items: dict[str, Item] = {}
        self.orders: list[Order] = []

    def add(self, item: Item):
        """Adds an item, or raises if its SKU is taken."""
        if item.sku in self.items:
            raise ValueError(f"SKU {item.sku} is already in the inventory")
        self.items[item.sku] = item

    def remove(self, sku: str) -> Item:
        """Removes an item and returns it."""
        if sku not in self.items:
            raise KeyError(f"no item with SKU {sku}")
        return self.items.pop(sku)

    def restock(self, sku: str, quantity: int):
        """Adds quantity units to an item's stock."""
        if quantity <= 0:
            raise ValueError("a restock adds at least one unit")
        self.items[sku].quantity += quantity

    def find(self, text: str) -> list[Item]:
        """The items whose name or tags contain text, ignoring case."""
        text = text.lower()
        return [
            item
            for item in self.items.values()
            if text in item.name.lower() or any(text in tag.lower() for tag in item.tags)
        ]

    def low_stock(self) -> list[Item]:
        """The items to reorder, fewest first."""
        return sorted((item for item in self.items.values() if item.is_low()), key=lambda item: item.quantity)

    def total_value(self) -> float:
        """What the whole stock is worth."""
        return sum(item.value() for item in self.items.values())

    def place_order(self, order: Order):
        """Takes an order's units out of stock, all lines or none."""
        for line in order.lines:
            item = self.items.get(line.sku)
            if item is None:
                raise KeyError(f"order {order.number}: no item with SKU {line.sku}")
            if item.quantity < line.quantity:
                raise ValueError(f"order {order.number}: only {item.quantity} of {item.name} in stock")
        for line in order.lines:
            self.items[line.sku].quantity -= line.quantity
        self.orders.append(order)

    def compute_total(self, order: Order) -> float:
        """An order's price, tax included."""
        subtotal = sum(self.items[line.sku].price * line.quantity for line in order.lines)
        return round(subtotal * (1 + TAX_RATE), 2)

    def revenue(self, day: date) -> float:
        """What the orders of a day brought in."""
        return sum(self.compute_total(order) for order in self.orders if order.day == day)

    def best_sellers(self, count: int = 3) -> list[tuple[str, int]]:
        """The SKUs sold most, with their units."""
        sold: dict[str, int] = {}
        for order in self.orders:
            for line in order.lines:
                sold[line.sku] = sold.get(line.sku, 0) + line.quantity
        return sorted(sold.items(), key=lambda pair: pair[1], reverse=True)[:count]


def load_items(path: Path) -> Inventory:
    """An inventory from a CSV file with the columns sku, name, price, quantity and tags."""
    inventory = Inventory()
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            tags = [tag.strip() for tag in row["tags"].split(";") if tag.strip()]
            inventory.add(Item(row["sku"], row["name"], float(row["price"]), int(row["quantity"]), tags))
    return inventory


def save_items(inventory: Inventory, path: Path):
    """Writes the inventory as the CSV file load_items reads."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sku", "name", "price", "quantity", "tags"])
        for item in inventory.items.values():
            writer.writerow([item.sku, item.name, item.price, item.quantity, ";".join(item.tags)])


def report(inventory: Inventory, day: date) -> str:
    """A day's summary: stock value, revenue, items to reorder and best sellers."""
    lines = [
        f"Report for {day.isoformat()}",
        f"Stock value: {inventory.total_value():.2f}",
        f"Revenue: {inventory.revenue(day):.2f}",
    ]
    low = inventory.low_stock()
    if low:
        lines.append("Reorder: " + ", ".join(f"{item.name} ({item.quantity})" for item in low))
    for sku, units in inventory.best_sellers():
        lines.append(f"Best seller: {inventory.items[sku].name if sku in inventory.items else sku}, {units} units")
    return "\n".join(lines)


def export_orders(inventory: Inventory, path: Path):
    """Writes every order, with its total, as JSON."""
    orders = [
        {
            "number": order.number,
            "customer": order.customer,
            "day": order.day.isoformat(),
            "lines": [{"sku": line.sku, "quantity": line.quantity} for line in order.lines],
            "total": inventory.compute_total(order),
        }
        for order in inventory.orders
    ]
    path.write_text(json.dumps(orders, indent=2))
