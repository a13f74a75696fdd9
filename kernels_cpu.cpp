// int8 linear layers on x86 CPUs by integer dot products, registered as the PyTorch operator gpt_fast::int8_linear.
//
// y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] for 1 to 8 rows of activations x (decode steps, small batches,
// speculative verification), with int8 weights w [N, K] and one float scale per output channel. As llama.cpp does
// for Q8_0, the activations are quantized to int8 per block of 32 values (code * block scale), each block's dot
// product is an exact int32, and only the sum over blocks is float. The unsigned-by-signed byte products of x86
// (vpmaddubsw, vpdpbusd) take |w| and the activation carrying w's sign (vpsignb): exact, because activation codes
// stay within [-127, 127] and the weights must too (kernels.Int8Linear checks that once).
//
// The ISA is an argument (kernels.py picks it from torch's CPU capability): 0 scalar reference, 1 AVX2,
// 2 AVX2 with AVX-VNNI, 3 AVX-512BW, 4 AVX-512 with VNNI. Each row of x is computed by the same instructions in the
// same order whatever the other rows are, so a row's result is bitwise the same alone or in a batch.
// kernels.py builds this file on first use (torch.utils.cpp_extension); without a compiler, today's PyTorch paths run.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t MAX_ROWS = 8;
// The weights stream from memory once per call: each load also asks for the bytes this far ahead, which the
// hardware prefetcher alone fetches too late (prefetching past the end is harmless: no fault, no use).
constexpr int64_t PREFETCH_BYTES = 4096;

// x [M, K] float -> codes [M, K] in [-127, 127] and one scale per block [M, K / BLOCK]: x ~ code * scale.
void quantize_blocks(const float* x, int64_t blocks, int8_t* codes, float* scales) {
  for (int64_t b = 0; b < blocks; b++) {
    const float* v = x + b * BLOCK;
    float amax = 0.f;
    for (int64_t j = 0; j < BLOCK; j++) amax = std::fmax(amax, std::fabs(v[j]));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    scales[b] = amax / 127.f;
    for (int64_t j = 0; j < BLOCK; j++) codes[b * BLOCK + j] = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
  }
}

// Each function computes C output channels (weight rows w, w + K, ...) for M activation rows, into out[c * M + m].
// A channel's sum over blocks runs in one accumulator per row, in block order, whatever C and M are: C only lets
// several independent sums hide the latency of the multiply-adds when M is small.

// The reference: every block's integer dot product, summed over blocks in order.
template <int M, int C>
void rows_scalar(const int8_t* w, const int8_t* a, const float* d, int64_t K, float* out) {
  for (int c = 0; c < C; c++) {
    for (int m = 0; m < M; m++) {
      float acc = 0.f;
      for (int64_t b = 0; b < K / BLOCK; b++) {
        int32_t dot = 0;
        for (int64_t j = 0; j < BLOCK; j++) dot += int32_t(w[c * K + b * BLOCK + j]) * int32_t(a[m * K + b * BLOCK + j]);
        acc += float(dot) * d[m * (K / BLOCK) + b];
      }
      out[c * M + m] = acc;
    }
  }
}

__attribute__((target("avx2,fma"))) inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 8 int32 lanes, lane i the sum of bytes 4i..4i+3 of |w| * (a with w's sign): the same with either instruction.
template <bool VNNI>
__attribute__((target("avx2,fma,avxvnni"))) inline __m256i dot32(__m256i w, __m256i a) {
  const __m256i magnitude = _mm256_sign_epi8(w, w), signed_a = _mm256_sign_epi8(a, w);
  if constexpr (VNNI) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), magnitude, signed_a);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_a), _mm256_set1_epi16(1));
  }
}

template <int M, int C, bool VNNI>
__attribute__((target("avx2,fma,avxvnni"))) void rows_avx2(
    const int8_t* w, const int8_t* a, const float* d, int64_t K, float* out) {
  const int64_t blocks = K / BLOCK;
  __m256 acc[C][M];
  for (int c = 0; c < C; c++)
    for (int m = 0; m < M; m++) acc[c][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    __m256i wv[C];
    for (int c = 0; c < C; c++) {
      _mm_prefetch(reinterpret_cast<const char*>(w + c * K + b * BLOCK + PREFETCH_BYTES), _MM_HINT_T0);
      wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * K + b * BLOCK));
    }
    for (int m = 0; m < M; m++) {
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * K + b * BLOCK));
      const __m256 scale = _mm256_set1_ps(d[m * blocks + b]);
      for (int c = 0; c < C; c++)
        acc[c][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32<VNNI>(wv[c], av)), scale, acc[c][m]);
    }
  }
  for (int c = 0; c < C; c++)
    for (int m = 0; m < M; m++) out[c * M + m] = sum8(acc[c][m]);
}

// Two blocks a step in 16 int32 lanes (lanes 0-7 the first block, 8-15 the second); an odd last block as AVX2 does.
template <bool VNNI>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,avxvnni"))) inline __m512i dot64(
    __m512i w, __m512i a) {
  const __m512i magnitude = _mm512_abs_epi8(w);
  const __m512i signed_a = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a);
  if constexpr (VNNI) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, signed_a);
  } else {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, signed_a), _mm512_set1_epi16(1));
  }
}

template <int M, int C, bool VNNI>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,avxvnni"))) void rows_avx512(
    const int8_t* w, const int8_t* a, const float* d, int64_t K, float* out) {
  const int64_t blocks = K / BLOCK;
  __m512 acc[C][M];
  for (int c = 0; c < C; c++)
    for (int m = 0; m < M; m++) acc[c][m] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    __m512i wv[C];
    for (int c = 0; c < C; c++) {
      _mm_prefetch(reinterpret_cast<const char*>(w + c * K + b * BLOCK + PREFETCH_BYTES), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + c * K + b * BLOCK + PREFETCH_BYTES + 63), _MM_HINT_T0);
      wv[c] = _mm512_loadu_si512(w + c * K + b * BLOCK);
    }
    for (int m = 0; m < M; m++) {
      const __m512i av = _mm512_loadu_si512(a + m * K + b * BLOCK);
      const float* dm = d + m * blocks + b;
      const __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(dm[0]), _mm512_set1_ps(dm[1]));
      for (int c = 0; c < C; c++)
        acc[c][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot64<VNNI>(wv[c], av)), scale, acc[c][m]);
    }
  }
  for (int c = 0; c < C; c++) {
    for (int m = 0; m < M; m++) {
      float tail = 0.f;
      if (b < blocks) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * K + b * BLOCK));
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * K + b * BLOCK));
        tail = sum8(_mm256_mul_ps(_mm256_cvtepi32_ps(dot32<false>(wv, av)), _mm256_set1_ps(d[m * blocks + b])));
      }
      out[c * M + m] = _mm512_reduce_add_ps(acc[c][m]) + tail;
    }
  }
}

using RowsFn = void (*)(const int8_t*, const int8_t*, const float*, int64_t, float*);

// Channels a call computes: 4 for one row, 2 for two, else one (M rows give M independent sums already).
constexpr int channels(int M) { return M == 1 ? 4 : M == 2 ? 2 : 1; }

template <int M, int C>
RowsFn rows_for(int64_t isa) {
  switch (isa) {
    case 1: return rows_avx2<M, C, false>;
    case 2: return rows_avx2<M, C, true>;
    case 3: return rows_avx512<M, C, false>;
    case 4: return rows_avx512<M, C, true>;
    default: return rows_scalar<M, C>;
  }
}

struct Kernel {
  RowsFn rows, tail;  // tail: one channel at a time, for the channels left over when C does not divide N
  int channels;
};

template <int M>
Kernel kernel_for(int64_t isa) {
  return {rows_for<M, channels(M)>(isa), rows_for<M, 1>(isa), channels(M)};
}

Kernel pick(int64_t rows, int64_t isa) {
  switch (rows) {
    case 1: return kernel_for<1>(isa);
    case 2: return kernel_for<2>(isa);
    case 3: return kernel_for<3>(isa);
    case 4: return kernel_for<4>(isa);
    case 5: return kernel_for<5>(isa);
    case 6: return kernel_for<6>(isa);
    case 7: return kernel_for<7>(isa);
    default: return kernel_for<8>(isa);
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t isa) {
  // x [M, K] float32 (M <= 8, K a multiple of 32), weight [N, K] int8, scales [N] float32 -> [M, N] float32
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) >= 1 && x.size(0) <= MAX_ROWS,
              "int8_linear: x must be float32 [M, K] with 1 <= M <= 8");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.size(1) == x.size(1),
              "int8_linear: weight must be int8 [N, K]");
  TORCH_CHECK(x.size(1) % BLOCK == 0, "int8_linear: K must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0), "int8_linear: scales [N]");
  TORCH_CHECK(isa >= 0 && isa <= 4, "int8_linear: isa must be 0..4");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), blocks = K / BLOCK;
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), sc = scales.contiguous();
  at::Tensor codes = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor block_scales = at::empty({M, blocks}, x.options());
  quantize_blocks(xc.data_ptr<float>(), M * blocks, codes.data_ptr<int8_t>(), block_scales.data_ptr<float>());
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t *w = wc.data_ptr<int8_t>(), *a = codes.data_ptr<int8_t>();
  const float *d = block_scales.data_ptr<float>(), *s = sc.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const Kernel kernel = pick(M, isa);
  const int64_t C = kernel.channels;
  at::parallel_for(0, (N + C - 1) / C, 16, [&](int64_t begin, int64_t end) {
    float column[4 * MAX_ROWS];
    for (int64_t n = begin * C; n < std::min(end * C, N); n += C) {
      const int64_t count = std::min(C, N - n);
      if (count == C) {
        kernel.rows(w + n * K, a, d, K, column);
      } else {
        for (int64_t c = 0; c < count; c++) kernel.tail(w + (n + c) * K, a, d, K, column + c * M);
      }
      for (int64_t c = 0; c < count; c++)
        for (int64_t m = 0; m < M; m++) out[m * N + n + c] = column[c * M + m] * s[n + c];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(gpt_fast, m) { m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, int isa) -> Tensor"); }

TORCH_LIBRARY_IMPL(gpt_fast, CPU, m) { m.impl("int8_linear", &int8_linear); }
