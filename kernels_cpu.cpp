// int8 and int4 linear layers on x86 CPUs by integer dot products, registered as the PyTorch operators
// gpt_fast::int8_linear and gpt_fast::int4_linear.
//
// y[m, n] = sum_k x[m, k] * w[n, k] for 1 to 8 rows of activations x (decode steps, small batches, speculative
// verification). As llama.cpp does for Q8_0 and Q4_1, the activations are quantized to int8 per block of 32 values
// (code * block scale), each block's dot product with the weight codes is an exact int32, and only the sum over
// blocks is float.
// - int8 weights: w = code * scale[n], codes in [-127, 127]. The unsigned-by-signed byte products of x86
//   (vpmaddubsw, vpdpbusd) take |w| and the activation carrying w's sign (vpsignb): exact, because activation codes
//   stay within [-127, 127] and the weights must too (kernels.Int8Linear checks that once).
// - int4 weights: w = code * scale + offset per block of 32 inputs, codes in [0, 15], scale and offset float16.
//   A block adds scale * d * dot(codes, activation codes) + offset * d * sum(activation codes): both terms see the
//   same quantized activations, so the result is the exact weights times them (with the float sum of x instead,
//   the rounding of x would meet the codes' positive weights, not the centred ones). Codes are unsigned, so they
//   go straight into the unsigned operand. Layout (kernels.Int4Linear.prepare): per 64 inputs, 32 bytes whose
//   low nibbles are inputs 0-31 and high nibbles inputs 32-63; scales and offsets [N, K / 32, 2].
//
// The ISA is an argument (kernels.py picks it from torch's CPU capability): 0 scalar reference, 1 AVX2,
// 2 AVX2 with AVX-VNNI, 3 AVX-512BW, 4 AVX-512 with VNNI. Each row of x is computed by the same instructions in the
// same order whatever the other rows are, so a row's result is bitwise the same alone or in a batch.
// kernels.py builds this file on first use (torch.utils.cpp_extension); without a compiler, today's PyTorch paths run.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
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

// The activations of one call, quantized per block of 32: x[m, k] ~ codes[m, k] * scale of its block.
struct Activations {
  const int8_t* codes;  // [M, K]
  const float* scales;  // [M, K / 32, 8]: each block's scale 8 times, one 256-bit vector (two blocks fill 512 bits)
  const float* sums;    // [M, K / 32, 2]: 0, then the block's scale times the sum of its codes: int4's offsets
                        // multiply the second of each pair, which lines it up with a channel's (scale, offset) pairs
  int64_t K, blocks;
};

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* codes, float* scales, float* sums) {
  for (int64_t b = 0; b < M * (K / BLOCK); b++) {
    const float* v = x + b * BLOCK;
    float amax = 0.f;
    for (int64_t j = 0; j < BLOCK; j++) amax = std::fmax(amax, std::fabs(v[j]));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < BLOCK; j++) {
      codes[b * BLOCK + j] = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
      sum += codes[b * BLOCK + j];
    }
    std::fill(scales + b * 8, scales + b * 8 + 8, amax / 127.f);
    sums[2 * b] = 0.f;
    sums[2 * b + 1] = amax / 127.f * float(sum);
  }
}

// Each function computes C output channels (weight rows w, w + row_bytes, ...) for M activation rows, into
// out[c * M + m]. A channel's sum over blocks runs in one accumulator per row, in block order, whatever C and M are:
// C only lets several independent sums hide the latency of the multiply-adds when M is small.

// ---------------------------------------------------------------- the scalar references

template <int M, int C>
void int8_scalar(const int8_t* w, const Activations& x, float* out) {
  for (int c = 0; c < C; c++) {
    for (int m = 0; m < M; m++) {
      float acc = 0.f;
      for (int64_t b = 0; b < x.blocks; b++) {
        int32_t dot = 0;
        for (int64_t j = 0; j < BLOCK; j++)
          dot += int32_t(w[c * x.K + b * BLOCK + j]) * int32_t(x.codes[m * x.K + b * BLOCK + j]);
        acc += float(dot) * x.scales[(m * x.blocks + b) * 8];
      }
      out[c * M + m] = acc;
    }
  }
}

template <int M, int C>
void int4_scalar(const uint8_t* w, const c10::Half* sz, const Activations& x, float* out) {
  for (int c = 0; c < C; c++) {
    for (int m = 0; m < M; m++) {
      float acc = 0.f;
      for (int64_t b = 0; b < x.blocks; b++) {
        const uint8_t* bytes = w + c * x.K / 2 + (b / 2) * BLOCK;  // 64 inputs: low nibbles first, then high
        int32_t dot = 0;
        for (int64_t j = 0; j < BLOCK; j++)
          dot += int32_t(b % 2 ? bytes[j] >> 4 : bytes[j] & 15) * int32_t(x.codes[m * x.K + b * BLOCK + j]);
        const float scale = sz[(c * x.blocks + b) * 2], offset = sz[(c * x.blocks + b) * 2 + 1];
        acc += float(dot) * (scale * x.scales[(m * x.blocks + b) * 8]) + offset * x.sums[(m * x.blocks + b) * 2 + 1];
      }
      out[c * M + m] = acc;
    }
  }
}

// ---------------------------------------------------------------- AVX2 (and AVX-VNNI)

#define AVX2 __attribute__((target("avx2,fma,f16c,avxvnni")))

AVX2 inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 8 int32 lanes, lane i the sum of bytes 4i..4i+3 of u * s, u unsigned and s signed, both within +-127 (no
// saturation in vpmaddubsw's int16 pairs): the same with either instruction.
template <bool VNNI>
AVX2 inline __m256i dot32(__m256i u, __m256i s) {
  if constexpr (VNNI) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
}

template <int M, int C, bool VNNI>
AVX2 void int8_avx2(const int8_t* w, const Activations& x, float* out) {
  __m256 acc[C][M];
  for (int c = 0; c < C; c++)
    for (int m = 0; m < M; m++) acc[c][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; b++) {
    __m256i magnitude[C], sign[C];
    for (int c = 0; c < C; c++) {
      _mm_prefetch(reinterpret_cast<const char*>(w + c * x.K + b * BLOCK + PREFETCH_BYTES), _MM_HINT_T0);
      sign[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * x.K + b * BLOCK));
      magnitude[c] = _mm256_sign_epi8(sign[c], sign[c]);
    }
    for (int m = 0; m < M; m++) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes + m * x.K + b * BLOCK));
      const __m256 scale = _mm256_loadu_ps(x.scales + (m * x.blocks + b) * 8);
      for (int c = 0; c < C; c++) {
        const __m256i dot = dot32<VNNI>(magnitude[c], _mm256_sign_epi8(a, sign[c]));
        acc[c][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[c][m]);
      }
    }
  }
  for (int c = 0; c < C; c++)
    for (int m = 0; m < M; m++) out[c * M + m] = sum8(acc[c][m]);
}

// The int4 codes of 64 inputs: lo holds inputs 0-31, hi inputs 32-63.
AVX2 inline void unpack64(const uint8_t* bytes, __m256i& lo, __m256i& hi) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)), low4 = _mm256_set1_epi8(15);
  lo = _mm256_and_si256(q, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
}

// sum over blocks of offset * (scale times the sum of the activation codes), from a channel's (scale, offset) pairs
// and a row's (0, sum) pairs: 4 blocks a step, then 2.
AVX2 inline float offset_terms(const c10::Half* sz, const float* sums, int64_t blocks) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    const __m256 pairs = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + b * 2)));
    acc = _mm256_fmadd_ps(pairs, _mm256_loadu_ps(sums + b * 2), acc);
  }
  __m128 tail = _mm_setzero_ps();
  if (b < blocks) {  // blocks is even (K a multiple of 64): two left
    const __m128 pairs = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sz + b * 2)));
    tail = _mm_mul_ps(pairs, _mm_loadu_ps(sums + b * 2));
  }
  return sum8(acc) + sum8(_mm256_castps128_ps256(tail));
}

template <int M, int C, bool VNNI>
AVX2 void int4_avx2(const uint8_t* w, const c10::Half* sz, const Activations& x, float* out) {
  __m256 acc[C][M];
  for (int c = 0; c < C; c++)
    for (int m = 0; m < M; m++) acc[c][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; b += 2) {  // two blocks a step: 32 bytes of codes
    __m256i codes[C][2];
    __m256 scale[C][2];
    for (int c = 0; c < C; c++) {
      const uint8_t* bytes = w + c * x.K / 2 + b * BLOCK / 2;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + PREFETCH_BYTES), _MM_HINT_T0);
      unpack64(bytes, codes[c][0], codes[c][1]);
      // scale, offset of block b, then of block b + 1
      const __m128 so = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sz + (c * x.blocks + b) * 2)));
      scale[c][0] = _mm256_broadcastss_ps(so);
      scale[c][1] = _mm256_broadcastss_ps(_mm_movehl_ps(so, so));
    }
    for (int m = 0; m < M; m++) {
      for (int h = 0; h < 2; h++) {
        const int64_t block = m * x.blocks + b + h;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes + block * BLOCK));
        const __m256 d = _mm256_loadu_ps(x.scales + block * 8);
        for (int c = 0; c < C; c++) {
          const __m256 dot = _mm256_cvtepi32_ps(dot32<VNNI>(codes[c][h], a));
          acc[c][m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, scale[c][h]), acc[c][m]);
        }
      }
    }
  }
  for (int c = 0; c < C; c++)
    for (int m = 0; m < M; m++)
      out[c * M + m] = sum8(acc[c][m]) + offset_terms(sz + c * x.blocks * 2, x.sums + m * x.blocks * 2, x.blocks);
}

// ---------------------------------------------------------------- AVX-512 (and VNNI)

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,avxvnni")))

// 16 int32 lanes, as dot32 for 64 bytes: lanes 0-7 the first 32 bytes (a block), lanes 8-15 the next one.
template <bool VNNI>
AVX512 inline __m512i dot64(__m512i u, __m512i s) {
  if constexpr (VNNI) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
  } else {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
  }
}

template <int M, int C, bool VNNI>
AVX512 void int8_avx512(const int8_t* w, const Activations& x, float* out) {
  __m512 acc[C][M];
  for (int c = 0; c < C; c++)
    for (int m = 0; m < M; m++) acc[c][m] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < x.blocks; b += 2) {
    __m512i magnitude[C];
    __mmask64 negative[C];
    for (int c = 0; c < C; c++) {
      const int8_t* bytes = w + c * x.K + b * BLOCK;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + PREFETCH_BYTES), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(bytes + PREFETCH_BYTES + 63), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(bytes);
      magnitude[c] = _mm512_abs_epi8(wv);
      negative[c] = _mm512_movepi8_mask(wv);
    }
    for (int m = 0; m < M; m++) {
      const __m512i a = _mm512_loadu_si512(x.codes + m * x.K + b * BLOCK);
      const __m512 scale = _mm512_loadu_ps(x.scales + (m * x.blocks + b) * 8);
      for (int c = 0; c < C; c++) {
        const __m512i signed_a = _mm512_mask_sub_epi8(a, negative[c], _mm512_setzero_si512(), a);
        acc[c][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot64<VNNI>(magnitude[c], signed_a)), scale, acc[c][m]);
      }
    }
  }
  for (int c = 0; c < C; c++) {
    for (int m = 0; m < M; m++) {
      float tail = 0.f;  // an odd last block, as AVX2 computes it
      if (b < x.blocks) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * x.K + b * BLOCK));
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes + m * x.K + b * BLOCK));
        const __m256 dot = _mm256_cvtepi32_ps(dot32<false>(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(a, wv)));
        tail = sum8(_mm256_mul_ps(dot, _mm256_loadu_ps(x.scales + (m * x.blocks + b) * 8)));
      }
      out[c * M + m] = _mm512_reduce_add_ps(acc[c][m]) + tail;
    }
  }
}

template <int M, int C, bool VNNI>
AVX512 void int4_avx512(const uint8_t* w, const c10::Half* sz, const Activations& x, float* out) {
  __m512 acc[C][M];
  for (int c = 0; c < C; c++)
    for (int m = 0; m < M; m++) acc[c][m] = _mm512_setzero_ps();
  // lanes 0-7 take block b's scale, lanes 8-15 block b + 1's (elements 0 and 2 of scale, offset, scale, offset)
  const __m512i spread = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  // the 32 bytes in both halves, shifted by 0 in the low half (inputs 0-31) and by 4 in the high one (32-63)
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < x.blocks; b += 2) {
    __m512i codes[C];
    __m512 scale[C];
    for (int c = 0; c < C; c++) {
      const uint8_t* bytes = w + c * x.K / 2 + b * BLOCK / 2;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + PREFETCH_BYTES), _MM_HINT_T0);
      const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
      codes[c] = _mm512_and_si512(_mm512_srlv_epi16(both, shifts), low4);
      const __m128 so = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sz + (c * x.blocks + b) * 2)));
      scale[c] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(so));
    }
    for (int m = 0; m < M; m++) {
      const int64_t block = m * x.blocks + b;
      const __m512i a = _mm512_loadu_si512(x.codes + block * BLOCK);
      const __m512 d = _mm512_loadu_ps(x.scales + block * 8);
      for (int c = 0; c < C; c++) {
        const __m512 dot = _mm512_cvtepi32_ps(dot64<VNNI>(codes[c], a));
        acc[c][m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, scale[c]), acc[c][m]);
      }
    }
  }
  for (int c = 0; c < C; c++)
    for (int m = 0; m < M; m++)
      out[c * M + m] =
          _mm512_reduce_add_ps(acc[c][m]) + offset_terms(sz + c * x.blocks * 2, x.sums + m * x.blocks * 2, x.blocks);
}

// ---------------------------------------------------------------- dispatch and the operators

// The weights of C channels from channel n on, whichever format: int8 rows, or int4 codes and their scales.
struct Weights {
  const int8_t* int8 = nullptr;
  const uint8_t* int4 = nullptr;
  const c10::Half* int4_scales = nullptr;
};
using RowsFn = void (*)(const Weights&, int64_t n, const Activations&, float*);

template <int M, int C, int ISA>
void int8_rows(const Weights& w, int64_t n, const Activations& x, float* out) {
  const int8_t* rows = w.int8 + n * x.K;
  if constexpr (ISA == 1 || ISA == 2) int8_avx2<M, C, ISA == 2>(rows, x, out);
  else if constexpr (ISA == 3 || ISA == 4) int8_avx512<M, C, ISA == 4>(rows, x, out);
  else int8_scalar<M, C>(rows, x, out);
}

template <int M, int C, int ISA>
void int4_rows(const Weights& w, int64_t n, const Activations& x, float* out) {
  const uint8_t* rows = w.int4 + n * x.K / 2;
  const c10::Half* sz = w.int4_scales + n * x.blocks * 2;
  if constexpr (ISA == 1 || ISA == 2) int4_avx2<M, C, ISA == 2>(rows, sz, x, out);
  else if constexpr (ISA == 3 || ISA == 4) int4_avx512<M, C, ISA == 4>(rows, sz, x, out);
  else int4_scalar<M, C>(rows, sz, x, out);
}

// Channels a call computes. int4, 4 for one row and 2 for two: independent sums that hide the latency of the
// multiply-adds (M rows give M of them already). int8, one: four int8 rows read at once stream from memory at about
// half the speed of one (four streams of K bytes each, too short for the prefetchers).
constexpr int channels(bool int4, int M) { return !int4 ? 1 : M == 1 ? 4 : M == 2 ? 2 : 1; }

template <bool INT4, int M, int C>
RowsFn rows_for(int64_t isa) {
  switch (isa) {
    case 1: return INT4 ? int4_rows<M, C, 1> : int8_rows<M, C, 1>;
    case 2: return INT4 ? int4_rows<M, C, 2> : int8_rows<M, C, 2>;
    case 3: return INT4 ? int4_rows<M, C, 3> : int8_rows<M, C, 3>;
    case 4: return INT4 ? int4_rows<M, C, 4> : int8_rows<M, C, 4>;
    default: return INT4 ? int4_rows<M, C, 0> : int8_rows<M, C, 0>;
  }
}

struct Kernel {
  RowsFn rows, tail;  // tail: one channel at a time, for the channels left over when C does not divide N
  int channels;
};

template <bool INT4, int M>
Kernel kernel_for(int64_t isa) {
  return {rows_for<INT4, M, channels(INT4, M)>(isa), rows_for<INT4, M, 1>(isa), channels(INT4, M)};
}

template <bool INT4>
Kernel pick(int64_t rows, int64_t isa) {
  switch (rows) {
    case 1: return kernel_for<INT4, 1>(isa);
    case 2: return kernel_for<INT4, 2>(isa);
    case 3: return kernel_for<INT4, 3>(isa);
    case 4: return kernel_for<INT4, 4>(isa);
    case 5: return kernel_for<INT4, 5>(isa);
    case 6: return kernel_for<INT4, 6>(isa);
    case 7: return kernel_for<INT4, 7>(isa);
    default: return kernel_for<INT4, 8>(isa);
  }
}

// x [M, K] float32 -> [M, N] float32: quantizes x once, then splits the N channels among torch's threads.
// channel_scales: int8's per-channel scales, or nullptr (int4 scales each block inside the kernel).
at::Tensor run(const at::Tensor& input, int64_t N, const Kernel& kernel, const Weights& w, const float* channel_scales) {
  const at::Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = K / BLOCK;
  // one allocation for the quantized activations: codes, then the replicated block scales, then the block sums
  at::Tensor buffer = at::empty({M * K + (M * blocks * 10) * 4}, x.options().dtype(at::kChar));
  int8_t* codes = buffer.data_ptr<int8_t>();
  float* scales = reinterpret_cast<float*>(codes + M * K);  // M * K is a multiple of 32: aligned for floats
  float* sums = scales + M * blocks * 8;
  quantize_rows(x.data_ptr<float>(), M, K, codes, scales, sums);
  const Activations a{codes, scales, sums, K, blocks};
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  const int64_t C = kernel.channels;
  at::parallel_for(0, (N + C - 1) / C, 16, [&](int64_t begin, int64_t end) {
    float column[4 * MAX_ROWS];
    for (int64_t n = begin * C; n < std::min(end * C, N); n += C) {
      const int64_t count = std::min(C, N - n);
      if (count == C) {
        kernel.rows(w, n, a, column);
      } else {
        for (int64_t c = 0; c < count; c++) kernel.tail(w, n + c, a, column + c * M);
      }
      for (int64_t c = 0; c < count; c++)
        for (int64_t m = 0; m < M; m++)
          out[m * N + n + c] = channel_scales ? column[c * M + m] * channel_scales[n + c] : column[c * M + m];
    }
  });
  return y;
}

void check_activations(const at::Tensor& x, int64_t multiple, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) >= 1 && x.size(0) <= MAX_ROWS,
              "x must be float32 [M, K] with 1 <= M <= 8");
  TORCH_CHECK(x.size(1) % multiple == 0, "K must be a multiple of ", multiple);
  TORCH_CHECK(isa >= 0 && isa <= 4, "isa must be 0..4");
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t isa) {
  // x [M, K] float32, weight [N, K] int8, scales [N] float32 -> [M, N] float32
  check_activations(x, BLOCK, isa);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.size(1) == x.size(1) &&
                  weight.is_contiguous(),
              "int8_linear: weight must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0) && scales.is_contiguous(),
              "int8_linear: scales must be float32 [N]");
  Weights w;
  w.int8 = weight.data_ptr<int8_t>();
  return run(x, weight.size(0), pick<false>(x.size(0), isa), w, scales.data_ptr<float>());
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t isa) {
  // x [M, K] float32, codes [N, K / 2] uint8 (this file's layout), scales [N, K / 32, 2] float16 -> [M, N] float32
  check_activations(x, 2 * BLOCK, isa);
  const int64_t N = codes.size(0), K = x.size(1);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.size(1) * 2 == K && codes.is_contiguous(),
              "int4_linear: codes must be contiguous uint8 [N, K / 2]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == N &&
                  scales.size(1) == K / BLOCK && scales.size(2) == 2 && scales.is_contiguous(),
              "int4_linear: scales must be contiguous float16 [N, K / 32, 2]");
  Weights w;
  w.int4 = codes.data_ptr<uint8_t>();
  w.int4_scales = scales.data_ptr<c10::Half>();
  return run(x, N, pick<true>(x.size(0), isa), w, nullptr);
}

}  // namespace

TORCH_LIBRARY(gpt_fast, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, int isa) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt_fast, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
