// int8 and int4 linear layers on x86 CPUs by integer dot products, registered as the PyTorch operators
// gpt_fast::int8_linear and gpt_fast::int4_linear; gpt_fast::int4_weights, which widens int4 weights to bfloat16;
// gpt_fast::half_linear, few-row products of bfloat16 / float16 weights; and gpt_fast::decode_attention, the attention
// of decode steps of several rows over the KV cache (these two AVX2 code, see their sections).
//
// y[m, n] = sum_k x[m, k] * w[n, k] for M rows of activations x (decode steps, batches, speculative verification;
// prompts where the CPU lacks bfloat16 matrix products). As llama.cpp does for Q8_0 and Q4_1, the activations are
// quantized to int8 per block of 32 values (code * block scale), each block's dot product with the weight codes is an
// exact int32, and only the sum over blocks is float.
// - int8 weights: w = code * scale[n], codes in [-127, 127]. The unsigned-by-signed byte products of x86
//   (vpmaddubsw, vpdpbusd) take |w| and the activation carrying w's sign (vpsignb): exact, because activation codes
//   stay within [-127, 127] and the weights must too (kernels.Int8Linear checks that once). AVX-512 VNNI takes
//   w + 128 instead, less 128 times the activations' sums (see int8_avx512): the same int32 sums. Layout
//   (kernels.int8_native_layout): channels interleaved in groups of 4, per group and 64 inputs each channel's 64
//   codes; the per-channel scales apart.
// - int4 weights: w = code * scale + offset per block of 32 inputs, codes in [0, 15], scale and offset float16.
//   A block adds scale * d * dot(codes, activation codes) + offset * d * sum(activation codes): both terms see the
//   same quantized activations, so the result is the exact weights times them (with the float sum of x instead,
//   the rounding of x would meet the codes' positive weights, not the centred ones). Codes are unsigned, so they
//   go straight into the unsigned operand. Layout (kernels.int4_native_layout): channels interleaved in groups of 4,
//   scales inline. Per group and 64 inputs (blocks 2s and 2s + 1), INT4_STEP bytes: each channel's 32 bytes of codes
//   (low nibbles inputs 0-31, high nibbles 32-63), then each channel's float16 scale and offset of block 2s, then of
//   block 2s + 1.
// Interleaved channels make one stream of bytes a thread (separate rows of K bytes each are streams too short for
// the prefetchers) and let 4 independent sums share each load of the activations.
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
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t MAX_ROWS = 8;  // rows a group's kernel calls cover before its outputs are written
constexpr int64_t ROW_BLOCK = 64;  // rows whose activations every group reads in turn (see run)
constexpr int64_t GROUP = 4;         // channels interleaved (see the layouts above)
constexpr int64_t INT8_STEP = 256;   // a group's bytes per 64 inputs: int8, 4 x 64 codes
constexpr int64_t INT4_STEP = 160;   // int4: 4 x 32 bytes of codes, then 4 x 4 float16 from byte SCALES_AT
constexpr int64_t SCALES_AT = 128;
// The weights stream from memory once per call. Where the hardware prefetcher alone fetches them too late, each load
// also asks for the bytes `ahead` of it (an operator's argument, kernels.Kernels.prefetch_bytes: on some CPUs the
// requests slow the stream instead, and 0 makes none). Prefetching past the end is harmless: no fault, no use.
// (The test of ahead stays in the loop's condition: written as an early return, GCC 12 deletes every request.)
inline void prefetch_ahead(const void* step, int64_t bytes, int64_t ahead) {
  for (int64_t line = 0; ahead != 0 && line < bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(step) + ahead + line, _MM_HINT_T0);
}

// The activations of one call, quantized per block of 32: x[m, k] ~ codes[m, k] * scale of its block.
struct Activations {
  const int8_t* codes;  // [M, K]
  const float* scales;  // [M, K / 32]: each block's scale
  const float* sums;    // [M, K / 32, 2]: 0, then the block's scale times the sum of its codes: int4's offsets
                        // multiply the second of each pair, which lines it up with a step's (scale, offset) pairs
  int64_t K, blocks;
  int64_t prefetch;  // the weights' bytes asked for ahead of each step (prefetch_ahead)

  Activations from_row(int64_t m) const {
    return {codes + m * K, scales + m * blocks, sums + m * blocks * 2, K, blocks, prefetch};
  }
};

// One block of 32 values: codes = round(v * 127 / max |v|), its scale max |v| / 127, and (0, scale * sum of codes).
void quantize_block(const float* v, int8_t* codes, float* scale, float* sums) {
  float amax = 0.f;
  for (int64_t j = 0; j < BLOCK; j++) amax = std::fmax(amax, std::fabs(v[j]));
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < BLOCK; j++) {
    codes[j] = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
    sum += codes[j];
  }
  *scale = amax / 127.f;
  sums[0] = 0.f;
  sums[1] = amax / 127.f * float(sum);
}

// Each function computes a group of 4 channels (its interleaved bytes) for R activation rows, into
// out[c * MAX_ROWS + r]. A channel's sum over blocks runs in one accumulator per row, in block order, whatever R is.

// ---------------------------------------------------------------- the scalar references

template <int R>
void int8_scalar(const int8_t* group, const Activations& x, float* out) {
  for (int c = 0; c < GROUP; c++) {
    for (int r = 0; r < R; r++) {
      float acc = 0.f;
      for (int64_t b = 0; b < x.blocks; b++) {
        const int8_t* codes = group + (b / 2) * INT8_STEP + c * 2 * BLOCK + (b % 2) * BLOCK;
        int32_t dot = 0;
        for (int64_t j = 0; j < BLOCK; j++) dot += int32_t(codes[j]) * int32_t(x.codes[r * x.K + b * BLOCK + j]);
        acc += float(dot) * x.scales[r * x.blocks + b];
      }
      out[c * MAX_ROWS + r] = acc;
    }
  }
}

template <int R>
void int4_scalar(const uint8_t* group, const Activations& x, float* out) {
  for (int c = 0; c < GROUP; c++) {
    for (int r = 0; r < R; r++) {
      float acc = 0.f, offsets = 0.f;
      for (int64_t b = 0; b < x.blocks; b++) {
        const uint8_t* step = group + (b / 2) * INT4_STEP;
        int32_t dot = 0;
        for (int64_t j = 0; j < BLOCK; j++) {
          const uint8_t byte = step[c * BLOCK + j];
          dot += int32_t(b % 2 ? byte >> 4 : byte & 15) * int32_t(x.codes[r * x.K + b * BLOCK + j]);
        }
        const c10::Half* so = reinterpret_cast<const c10::Half*>(step + SCALES_AT) + c * 4 + (b % 2) * 2;
        acc += float(dot) * (float(so[0]) * x.scales[r * x.blocks + b]);
        offsets += float(so[1]) * x.sums[(r * x.blocks + b) * 2 + 1];
      }
      out[c * MAX_ROWS + r] = acc + offsets;
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

template <int R, bool VNNI>
AVX2 void int8_avx2(const int8_t* group, const Activations& x, float* out) {
  __m256 acc[GROUP][R];
  for (int c = 0; c < GROUP; c++)
    for (int r = 0; r < R; r++) acc[c][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; b += 2) {
    const int8_t* step = group + (b / 2) * INT8_STEP;
    prefetch_ahead(step, INT8_STEP, x.prefetch);
    for (int h = 0; h < 2; h++) {  // block b + h: bytes 32h.. of each channel's 64
      __m256i sign[GROUP], magnitude[GROUP];
      for (int c = 0; c < GROUP; c++) {
        sign[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + c * 2 * BLOCK + h * BLOCK));
        magnitude[c] = _mm256_sign_epi8(sign[c], sign[c]);
      }
      for (int r = 0; r < R; r++) {
        const int64_t block = r * x.blocks + b + h;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes + block * BLOCK));
        const __m256 scale = _mm256_broadcast_ss(x.scales + block);
        for (int c = 0; c < GROUP; c++) {
          const __m256i dot = dot32<VNNI>(magnitude[c], _mm256_sign_epi8(a, sign[c]));
          acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[c][r]);
        }
      }
    }
  }
  for (int c = 0; c < GROUP; c++)
    for (int r = 0; r < R; r++) out[c * MAX_ROWS + r] = sum8(acc[c][r]);
}

// quantize_block with AVX2: the same operations on 8 values a vector (rounding to nearest even, as nearbyint does
// in the default rounding mode), so the same codes, scale and sum.
AVX2 void quantize_block_avx2(const float* v, int8_t* codes, float* scale, float* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 x[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(x[i], magnitude));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const __m256 inverse = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i q[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; i++) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(x[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[i] = _mm256_cvtps_epi32(r);
    sum = _mm256_add_epi32(sum, q[i]);
  }
  // int32 -> int8 with packs, which interleave the 128-bit lanes: the permutation puts the 32 codes back in order
  const __m256i words = _mm256_packs_epi32(q[0], q[1]), words2 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), bytes);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  *scale = top / 127.f;
  sums[0] = 0.f;
  sums[1] = top / 127.f * float(_mm_cvtsi128_si32(s));
}

// The int4 codes of 64 inputs: lo holds inputs 0-31, hi inputs 32-63.
AVX2 inline void unpack64(const uint8_t* bytes, __m256i& lo, __m256i& hi) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)), low4 = _mm256_set1_epi8(15);
  lo = _mm256_and_si256(q, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
}

// Each step: channels 0-1's (scale, offset) pairs in one vector of 8 floats, channels 2-3's in another. The offsets
// accumulate in offsets[pair][r] against a row's (0, sum, 0, sum) of the two blocks; the scale lanes meet the zeros.
template <int R, bool VNNI>
AVX2 void int4_avx2(const uint8_t* group, const Activations& x, float* out) {
  __m256 acc[GROUP][R], offsets[2][R];
  for (int r = 0; r < R; r++) {
    for (int c = 0; c < GROUP; c++) acc[c][r] = _mm256_setzero_ps();
    offsets[0][r] = offsets[1][r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < x.blocks; b += 2) {
    const uint8_t* step = group + (b / 2) * INT4_STEP;
    prefetch_ahead(step, INT4_STEP, x.prefetch);
    __m256 so[2];
    for (int pair = 0; pair < 2; pair++)
      so[pair] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step + SCALES_AT + pair * 16)));
    for (int r = 0; r < R; r++) {
      const __m256 sums = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x.sums + (r * x.blocks + b) * 2));
      for (int pair = 0; pair < 2; pair++) offsets[pair][r] = _mm256_fmadd_ps(so[pair], sums, offsets[pair][r]);
    }
    for (int c = 0; c < GROUP; c++) {
      __m256i codes[2];
      unpack64(step + c * BLOCK, codes[0], codes[1]);
      for (int h = 0; h < 2; h++) {  // block b + h: its scale is lane (c % 2) * 4 + h * 2 of so[c / 2]
        const __m256 scale = _mm256_permutevar8x32_ps(so[c / 2], _mm256_set1_epi32((c % 2) * 4 + h * 2));
        for (int r = 0; r < R; r++) {
          const int64_t block = r * x.blocks + b + h;
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes + block * BLOCK));
          const __m256 d = _mm256_broadcast_ss(x.scales + block);
          const __m256 dot = _mm256_cvtepi32_ps(dot32<VNNI>(codes[h], a));
          acc[c][r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, scale), acc[c][r]);
        }
      }
    }
  }
  for (int r = 0; r < R; r++) {
    float lanes[2][8];
    for (int pair = 0; pair < 2; pair++) _mm256_storeu_ps(lanes[pair], offsets[pair][r]);
    for (int c = 0; c < GROUP; c++) {
      const float* own = lanes[c / 2] + (c % 2) * 4;  // (scale * 0, offset * sum) of block b, then of block b + 1
      out[c * MAX_ROWS + r] = sum8(acc[c][r]) + (own[1] + own[3]);
    }
  }
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

// Lanes 0-7 block b's activation scale d[0], lanes 8-15 block b + 1's d[1] (dot64's blocks).
AVX512 inline __m512 two_scales(const float* d) {
  const __m512d low = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_broadcast_ss(d)));
  return _mm512_castpd_ps(_mm512_insertf64x4(low, _mm256_castps_pd(_mm256_broadcast_ss(d + 1)), 1));
}

template <int R, bool VNNI>
AVX512 void int8_avx512(const int8_t* group, const Activations& x, float* out) {
  __m512 acc[GROUP][R];
  for (int c = 0; c < GROUP; c++)
    for (int r = 0; r < R; r++) acc[c][r] = _mm512_setzero_ps();
  const __m512i bias = _mm512_set1_epi8(-128);  // the byte 0x80: +128 unsigned
  for (int64_t b = 0; b < x.blocks; b += 2) {
    const int8_t* step = group + (b / 2) * INT8_STEP;
    prefetch_ahead(step, INT8_STEP, x.prefetch);
    // VNNI: the weights + 128 as unsigned bytes, and each product with a row starts from -128 times the row's sums
    // of 4 codes (which vpdpbusd adds to): the same int32 lanes as |w| by a carrying w's sign, with the row's
    // share computed once for the 4 channels. Without VNNI, vpmaddubsw's int16 pairs would saturate on w + 128.
    __m512i weights[GROUP];
    __mmask64 negative[GROUP];
    for (int c = 0; c < GROUP; c++) {
      const __m512i wv = _mm512_loadu_si512(step + c * 2 * BLOCK);
      weights[c] = VNNI ? _mm512_xor_si512(wv, bias) : _mm512_abs_epi8(wv);
      if constexpr (!VNNI) negative[c] = _mm512_movepi8_mask(wv);
    }
    for (int r = 0; r < R; r++) {
      const int64_t block = r * x.blocks + b;
      const __m512i a = _mm512_loadu_si512(x.codes + block * BLOCK);
      const __m512 scale = two_scales(x.scales + block);
      if constexpr (VNNI) {
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), dot64<true>(bias, a));
        for (int c = 0; c < GROUP; c++) {
          const __m512i dot = _mm512_dpbusd_epi32(start, weights[c], a);
          acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[c][r]);
        }
      } else {
        for (int c = 0; c < GROUP; c++) {
          const __m512i signed_a = _mm512_mask_sub_epi8(a, negative[c], _mm512_setzero_si512(), a);
          acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot64<false>(weights[c], signed_a)), scale, acc[c][r]);
        }
      }
    }
  }
  for (int c = 0; c < GROUP; c++)
    for (int r = 0; r < R; r++) out[c * MAX_ROWS + r] = _mm512_reduce_add_ps(acc[c][r]);
}

// Each step: the 4 channels' (scale, offset) pairs of both blocks in one vector of 16 floats (channel c at lanes
// 4c..4c+3); the offsets accumulate against a row's (0, sum, 0, sum) of the two blocks, 4 times over.
template <int R, bool VNNI>
AVX512 void int4_avx512(const uint8_t* group, const Activations& x, float* out) {
  __m512 acc[GROUP][R], offsets[R];
  for (int r = 0; r < R; r++) {
    for (int c = 0; c < GROUP; c++) acc[c][r] = _mm512_setzero_ps();
    offsets[r] = _mm512_setzero_ps();
  }
  // the 32 bytes in both halves, shifted by 0 in the low half (inputs 0-31) and by 4 in the high one (32-63)
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < x.blocks; b += 2) {
    const uint8_t* step = group + (b / 2) * INT4_STEP;
    prefetch_ahead(step, INT4_STEP, x.prefetch);
    const __m512 so = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + SCALES_AT)));
    __m512i codes[GROUP];
    __m512 scale[GROUP];
    for (int c = 0; c < GROUP; c++) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + c * BLOCK));
      const __m512i both = _mm512_broadcast_i64x4(bytes);
      codes[c] = _mm512_and_si512(_mm512_srlv_epi16(both, shifts), low4);
      // lanes 0-7: block b's scale (lane 4c of so), lanes 8-15: block b + 1's (lane 4c + 2)
      const __m512i lanes = _mm512_inserti64x4(_mm512_set1_epi32(4 * c), _mm256_set1_epi32(4 * c + 2), 1);
      scale[c] = _mm512_permutexvar_ps(lanes, so);
    }
    for (int r = 0; r < R; r++) {
      const int64_t block = r * x.blocks + b;
      const __m512i a = _mm512_loadu_si512(x.codes + block * BLOCK);
      const __m512 d = two_scales(x.scales + block);
      offsets[r] = _mm512_fmadd_ps(so, _mm512_broadcast_f32x4(_mm_loadu_ps(x.sums + block * 2)), offsets[r]);
      for (int c = 0; c < GROUP; c++) {
        const __m512 dot = _mm512_cvtepi32_ps(dot64<VNNI>(codes[c], a));
        acc[c][r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, scale[c]), acc[c][r]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    float lanes[16];
    _mm512_storeu_ps(lanes, offsets[r]);
    for (int c = 0; c < GROUP; c++)  // (scale * 0, offset * sum) of block b, then of block b + 1
      out[c * MAX_ROWS + r] = _mm512_reduce_add_ps(acc[c][r]) + (lanes[4 * c + 1] + lanes[4 * c + 3]);
  }
}

// ---------------------------------------------------------------- dispatch and the operators

// A kernel computes a group of 4 channels for R rows (see above).
using GroupFn = void (*)(const uint8_t* group, const Activations&, float* out);

template <int R, int ISA>
void int8_group(const uint8_t* bytes, const Activations& x, float* out) {
  const int8_t* group = reinterpret_cast<const int8_t*>(bytes);
  if constexpr (ISA == 1 || ISA == 2) int8_avx2<R, ISA == 2>(group, x, out);
  else if constexpr (ISA == 3 || ISA == 4) int8_avx512<R, ISA == 4>(group, x, out);
  else int8_scalar<R>(group, x, out);
}

template <int R, int ISA>
void int4_group(const uint8_t* group, const Activations& x, float* out) {
  if constexpr (ISA == 1 || ISA == 2) int4_avx2<R, ISA == 2>(group, x, out);
  else if constexpr (ISA == 3 || ISA == 4) int4_avx512<R, ISA == 4>(group, x, out);
  else int4_scalar<R>(group, x, out);
}

// A group's kernel for R = 1..4 rows; a call covers as many rows as the sums fit the registers (most_rows), and a
// group's bytes read again for the next rows come from the cache.
using QuantizeFn = void (*)(const float* v, int8_t* codes, float* scale, float* sums);
struct Kernel {
  GroupFn rows[4];  // rows[R - 1] computes R rows, for R up to most_rows
  int64_t most_rows, step_bytes;
  QuantizeFn quantize;  // of a block of activations
};

// AVX-512's 32 registers hold int8's sums of 4 rows; AVX2's 16, and int4's codes and scales beside them, 2.
template <int ISA>
Kernel kernel_for(bool int4) {
  const QuantizeFn quantize = ISA == 0 ? quantize_block : quantize_block_avx2;
  if (int4) return Kernel{{int4_group<1, ISA>, int4_group<2, ISA>}, 2, INT4_STEP, quantize};
  if constexpr (ISA >= 3)
    return Kernel{{int8_group<1, ISA>, int8_group<2, ISA>, int8_group<3, ISA>, int8_group<4, ISA>}, 4, INT8_STEP,
                  quantize};
  return Kernel{{int8_group<1, ISA>, int8_group<2, ISA>}, 2, INT8_STEP, quantize};
}

Kernel pick(bool int4, int64_t isa) {
  switch (isa) {
    case 1: return kernel_for<1>(int4);
    case 2: return kernel_for<2>(int4);
    case 3: return kernel_for<3>(int4);
    case 4: return kernel_for<4>(int4);
    default: return kernel_for<0>(int4);
  }
}

// x [M, K] float32 -> [M, N] float32: quantizes x once (its blocks split among torch's threads), then splits the groups
// of channels among them.
// channel_scales: int8's per-channel scales, or nullptr (int4 scales each block inside the kernel).
at::Tensor run(const at::Tensor& input, const at::Tensor& packed, const Kernel& kernel, const float* channel_scales,
               int64_t prefetch) {
  const at::Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = K / BLOCK, N = packed.size(0) * GROUP;
  // one allocation for the quantized activations: codes, then the block scales, then the block sums
  at::Tensor buffer = at::empty({M * K + (M * blocks * 3) * 4}, x.options().dtype(at::kChar));
  int8_t* codes = buffer.data_ptr<int8_t>();
  float* scales = reinterpret_cast<float*>(codes + M * K);  // M * K is a multiple of 32: aligned for floats
  float* sums = scales + M * blocks;
  const float* values = x.data_ptr<float>();
  at::parallel_for(0, M * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b++)
      kernel.quantize(values + b * BLOCK, codes + b * BLOCK, scales + b, sums + 2 * b);
  });
  const Activations a{codes, scales, sums, K, blocks, prefetch};
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  const uint8_t* weights = static_cast<const uint8_t*>(packed.data_ptr());
  const int64_t group_bytes = K / 64 * kernel.step_bytes;
  // Rows by blocks of ROW_BLOCK, whose quantized activations stay in the cache while every group of channels
  // reads them; within a group, MAX_ROWS at a time while its bytes stay in L1.
  for (int64_t first = 0; first < M; first += ROW_BLOCK) {
    const int64_t last = std::min(M, first + ROW_BLOCK);
    at::parallel_for(0, N / GROUP, 16, [&](int64_t begin, int64_t end) {
      float column[GROUP * MAX_ROWS];  // column[c * MAX_ROWS + m]: the group's channel c, row m0 + m
      for (int64_t g = begin; g < end; g++) {
        for (int64_t m0 = first; m0 < last; m0 += MAX_ROWS) {
          const int64_t rows = std::min(MAX_ROWS, last - m0);
          for (int64_t m = 0; m < rows; m += kernel.most_rows) {
            const int64_t r = std::min(kernel.most_rows, rows - m);
            kernel.rows[r - 1](weights + g * group_bytes, a.from_row(m0 + m), column + m);
          }
          for (int64_t c = 0; c < GROUP; c++) {
            const int64_t n = g * GROUP + c;
            for (int64_t m = 0; m < rows; m++)
              out[(m0 + m) * N + n] =
                  channel_scales ? column[c * MAX_ROWS + m] * channel_scales[n] : column[c * MAX_ROWS + m];
          }
        }
      }
    });
  }
  return y;
}

// int4 layout [N / 4, K / 64, INT4_STEP] -> the weights [N, K] (code * scale + offset) in bfloat16, for a matrix
// product of many rows on the library's bfloat16 GEMM (CPUs with native bfloat16): the widening is paid once per
// call instead of once per row. Rounded to nearest even, as c10::BFloat16 rounds.

// One channel's 64 weights of a step: scalar.
inline void widen64_scalar(const uint8_t* codes, const c10::Half* so, c10::BFloat16* w) {
  for (int64_t j = 0; j < BLOCK; j++) w[j] = c10::BFloat16(float(codes[j] & 15) * float(so[0]) + float(so[1]));
  for (int64_t j = 0; j < BLOCK; j++) w[BLOCK + j] = c10::BFloat16(float(codes[j] >> 4) * float(so[2]) + float(so[3]));
}

// The same with AVX-512 BF16: 16 weights a vector.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void widen64_avx512(
    const uint8_t* codes, const c10::Half* so, c10::BFloat16* w) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)), low4 = _mm256_set1_epi8(15);
  const __m256i nibbles[2] = {_mm256_and_si256(bytes, low4), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4)};
  for (int h = 0; h < 2; h++) {  // low nibbles: inputs 0-31 (block 2s), high nibbles: 32-63 (block 2s + 1)
    const __m512 scale = _mm512_set1_ps(float(so[2 * h])), offset = _mm512_set1_ps(float(so[2 * h + 1]));
    for (int q = 0; q < 2; q++) {
      const __m128i sixteen = q ? _mm256_extracti128_si256(nibbles[h], 1) : _mm256_castsi256_si128(nibbles[h]);
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sixteen)), scale, offset);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + h * BLOCK + q * 16), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

at::Tensor int4_weights(const at::Tensor& packed) {
  // packed [N / 4, K / 64, INT4_STEP] uint8 -> [N, K] bfloat16
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == INT4_STEP &&
                  packed.is_contiguous(),
              "int4_weights: packed must be contiguous [N / 4, K / 64, ", INT4_STEP, "] uint8 (kernels.py's layout)");
  const int64_t N = packed.size(0) * GROUP, K = packed.size(1) * 64, steps = K / 64;
  at::Tensor weights = at::empty({N, K}, packed.options().dtype(at::kBFloat16));
  const uint8_t* bytes = packed.data_ptr<uint8_t>();
  c10::BFloat16* out = weights.data_ptr<c10::BFloat16>();
  const auto widen64 = __builtin_cpu_supports("avx512bf16") ? widen64_avx512 : widen64_scalar;
  at::parallel_for(0, N / GROUP, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g++) {
      for (int64_t s = 0; s < steps; s++) {
        const uint8_t* step = bytes + (g * steps + s) * INT4_STEP;
        const c10::Half* so = reinterpret_cast<const c10::Half*>(step + SCALES_AT);
        for (int64_t c = 0; c < GROUP; c++) widen64(step + c * BLOCK, so + c * 4, out + (g * GROUP + c) * K + s * 64);
      }
    }
  });
  return weights;
}

// ---------------------------------------------------------------- half-precision weights

// bfloat16 or float16 weights [N, K] as they are (no layout of our own) times x [M, K] float32 -> [M, N] float32, for
// products of a few rows (kernels.runs_half_native). A compiled step's fused product (kernels.linear) widens the
// activation again for each output's sum; here x is float32 once and each weight is widened once in registers.
// Channels are taken one after the other, each row of weights read start to end: the whole matrix is one sequential
// stream a thread (interleaving a few channels' rows made as many short streams, read more slowly), whose lines are
// asked for ahead of use where the caller says so (prefetch_ahead): on some CPUs widening takes instructions enough
// per line that the loads in flight alone do not keep the memory busy, which the fused product, without prefetches,
// cannot help.

// 8 weights widened to float32: bfloat16 by a shift, float16 by F16C.
AVX2 inline __m256 widen8(const c10::BFloat16* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
AVX2 inline __m256 widen8(const c10::Half* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}

// One channel's weights w[0..K) times one row x: 32 inputs a pass into 4 independent sums of 8 lanes (one sum would
// wait on each FMA's latency), then 8 at a time. K a multiple of 8.
template <typename T>
AVX2 float row_dot(const T* w, const float* x, int64_t K, int64_t prefetch) {
  __m256 acc[4];
  for (int i = 0; i < 4; i++) acc[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    prefetch_ahead(w + k, 32 * sizeof(T), prefetch);
    for (int i = 0; i < 4; i++) acc[i] = _mm256_fmadd_ps(widen8(w + k + 8 * i), _mm256_loadu_ps(x + k + 8 * i), acc[i]);
  }
  for (; k < K; k += 8) acc[0] = _mm256_fmadd_ps(widen8(w + k), _mm256_loadu_ps(x + k), acc[0]);
  return sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

template <typename T>
void rows_times(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y, int64_t prefetch) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const T* w = weight.data_ptr<T>();
  const float* rows = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++)
      for (int64_t m = 0; m < M; m++) out[m * N + n] = row_dot(w + n * K, rows + m * K, K, prefetch);
  });
}

at::Tensor half_linear(const at::Tensor& x, const at::Tensor& weight, int64_t prefetch) {
  // x [M, K] float32, weight [N, K] bfloat16 or float16 -> [M, N] float32
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 8 == 0,
              "half_linear: x must be float32 [M, K] with K a multiple of 8");
  const auto type = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (type == at::kBFloat16 || type == at::kHalf) && weight.size(1) == x.size(1) &&
                  weight.is_contiguous(),
              "half_linear: the weight must be contiguous bfloat16 or float16 [N, K]");
  TORCH_CHECK(prefetch >= 0, "prefetch must be a number of bytes >= 0");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  if (type == at::kBFloat16) rows_times<c10::BFloat16>(xc, weight, y, prefetch);
  else rows_times<c10::Half>(xc, weight, y, prefetch);
  return y;
}

// ---------------------------------------------------------------- decode attention

// softmax(q k^T * scale) v for one query a row (a decode step of several sequences: kernels.runs_native_attention),
// in float32 from keys and values as the KV cache holds them. q [B, H, 1, D], k and v [B, H_kv, T, D] with D
// contiguous (views of the cache at any other strides), mask [B, 1, 1, T]; query head i reads KV head i / (H / H_kv).
// A compiled step's fused multiply-and-sums read the keys once per query head and the values once per output lane
// group, each stream too short for the hardware prefetcher; here a thread takes one (row, KV head) at a time and reads
// its keys once for all the heads that share them, 8 positions a pass, asking for the lines ahead of use, then its
// values once for up to 4 of those heads. The work items are the same whatever the other rows are, so a row's result
// is bitwise the same alone or in a batch.

constexpr int64_t KEYS_AHEAD = 16;   // positions whose keys are asked for ahead of their scores
constexpr int64_t VALUES_AHEAD = 8;  // positions whose values are asked for ahead of their sums
constexpr int HEADS_A_PASS = 4;      // query heads whose outputs one pass over the values computes

// Lane i: the sum of a[i]'s 8 lanes.
AVX2 inline __m256 sums8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);  // each half: lanes 0-3's sums
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

AVX2 inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// e^x for x <= 0 (a score less the maximum), 0 below -87 (where float32's e^x would be subnormal) and for -inf:
// x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, Cody and Waite), e^r by its Taylor polynomial to degree 7,
// 2^n from the exponent bits.
AVX2 inline __m256 exp8(__m256 x) {
  const __m256 kept = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 1.f / 2, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), kept);
}

// out[g, :] = sum_t w[g, t] v[t, :] / total[g] for HEADS query heads, 16 lanes of D a pass.
template <int HEADS>
AVX2 void weighted_values(const float* w, int64_t w_stride, const float* v, int64_t v_stride, int64_t T, int64_t D,
                          const float* total, float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m256 acc[HEADS][2];
    for (int g = 0; g < HEADS; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    for (int64_t t = 0; t < T; t++) {
      const float* row = v + t * v_stride + d0;
      if (d0 == 0) prefetch_ahead(v + t * v_stride, D * sizeof(float), VALUES_AHEAD * v_stride * sizeof(float));
      const __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
      for (int g = 0; g < HEADS; g++) {
        const __m256 p = _mm256_broadcast_ss(w + g * w_stride + t);
        acc[g][0] = _mm256_fmadd_ps(p, v0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(p, v1, acc[g][1]);
      }
    }
    for (int g = 0; g < HEADS; g++) {
      const __m256 inverse = _mm256_set1_ps(1.f / total[g]);
      _mm256_storeu_ps(out + g * D + d0, _mm256_mul_ps(acc[g][0], inverse));
      _mm256_storeu_ps(out + g * D + d0 + 8, _mm256_mul_ps(acc[g][1], inverse));
    }
  }
}

struct AttentionInputs {
  const float *q, *k, *v;
  const bool* mask;  // [B, T]
  float* y;          // [B, H, D]
  int64_t H, H_kv, T, D;
  int64_t k_row, k_head, k_pos, v_row, v_head, v_pos;  // strides
  float scale;
};

// Items begin..end-1, item = row * H_kv + KV head.
AVX2 void attend_items(const AttentionInputs& a, int64_t begin, int64_t end) {
  const int64_t G = a.H / a.H_kv, TP = (a.T + 7) / 8 * 8, D = a.D, T = a.T;
  std::vector<float> scores(G * TP), total(G);  // per query head, padded to whole passes of 8 positions
  for (int64_t item = begin; item < end; item++) {
    const int64_t b = item / a.H_kv, h = item % a.H_kv;
    const float* q = a.q + (b * a.H + h * G) * D;
    const float* k = a.k + b * a.k_row + h * a.k_head;
    const bool* mask = a.mask + b * T;
    for (int64_t t0 = 0; t0 < TP; t0 += 8) {
      const float* keys[8];
      for (int i = 0; i < 8; i++) keys[i] = k + std::min(t0 + i, T - 1) * a.k_pos;
      for (int i = 0; i < 8; i++) prefetch_ahead(keys[i], D * sizeof(float), KEYS_AHEAD * a.k_pos * sizeof(float));
      for (int64_t g = 0; g < G; g++) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qd = _mm256_loadu_ps(q + g * D + d);
          for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(keys[i] + d), acc[i]);
        }
        _mm256_storeu_ps(scores.data() + g * TP + t0, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(a.scale)));
      }
    }
    for (int64_t g = 0; g < G; g++) {
      float* s = scores.data() + g * TP;
      for (int64_t t = 0; t < TP; t++)
        if (t >= T || !mask[t]) s[t] = -INFINITY;
      __m256 most = _mm256_set1_ps(-INFINITY);
      for (int64_t t = 0; t < TP; t += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(s + t));
      const __m256 shift = _mm256_set1_ps(max8(most));
      __m256 sum = _mm256_setzero_ps();
      for (int64_t t = 0; t < TP; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
      }
      total[g] = sum8(sum);
    }
    const float* v = a.v + b * a.v_row + h * a.v_head;
    for (int64_t g = 0; g < G; g += HEADS_A_PASS) {
      const float* w = scores.data() + g * TP;
      float* out = a.y + (b * a.H + h * G + g) * D;
      switch (std::min<int64_t>(HEADS_A_PASS, G - g)) {
        case 4: weighted_values<4>(w, TP, v, a.v_pos, T, D, total.data() + g, out); break;
        case 3: weighted_values<3>(w, TP, v, a.v_pos, T, D, total.data() + g, out); break;
        case 2: weighted_values<2>(w, TP, v, a.v_pos, T, D, total.data() + g, out); break;
        default: weighted_values<1>(w, TP, v, a.v_pos, T, D, total.data() + g, out);
      }
    }
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.scalar_type() == at::kFloat && q.size(3) % 16 == 0,
              "decode_attention: q must be float32 [B, H, 1, D] with D a multiple of 16");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->size(0) == B && t->size(3) == D &&
                    t->stride(3) == 1 && t->sizes() == k.sizes(),
                "decode_attention: k and v must be float32 [B, H_kv, T, D] alike, D contiguous");
  const int64_t H_kv = k.size(1), T = k.size(2);
  TORCH_CHECK(H_kv > 0 && H % H_kv == 0 && T > 0, "decode_attention: H must be a multiple of H_kv, and T > 0");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.numel() == B * T && mask.size(-1) == T,
              "decode_attention: mask must be bool [B, 1, 1, T]");
  const at::Tensor qc = q.contiguous(), mc = mask.reshape({B, T}).contiguous();
  at::Tensor y = at::empty({B, H, 1, D}, q.options());
  const AttentionInputs a{qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), mc.data_ptr<bool>(),
                          y.data_ptr<float>(), H, H_kv, T, D, k.stride(0), k.stride(1), k.stride(2),
                          v.stride(0), v.stride(1), v.stride(2), static_cast<float>(scale)};
  at::parallel_for(0, B * H_kv, 1, [&](int64_t begin, int64_t end) { attend_items(a, begin, end); });
  return y;
}

// x [M, K] float32 with M >= 1 and K a multiple of 64; packed [N / 4, K / 64, step_bytes]
void check_inputs(const at::Tensor& x, const at::Tensor& packed, at::ScalarType type, int64_t step, int64_t isa,
                  int64_t prefetch) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) >= 1 && x.size(1) % 64 == 0,
              "x must be float32 [M, K] with M >= 1 and K a multiple of 64");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == type && packed.size(1) == x.size(1) / 64 &&
                  packed.size(2) == step && packed.is_contiguous(),
              "the weights must be contiguous [N / 4, K / 64, ", step, "] of ", type, " (kernels.py's layout)");
  TORCH_CHECK(isa >= 0 && isa <= 4, "isa must be 0..4");
  TORCH_CHECK(prefetch >= 0, "prefetch must be a number of bytes >= 0");
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t isa,
                       int64_t prefetch) {
  // x [M, K] float32, packed [N / 4, K / 64, INT8_STEP] int8, scales [N] float32 -> [M, N] float32
  check_inputs(x, packed, at::kChar, INT8_STEP, isa, prefetch);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == packed.size(0) * GROUP && scales.is_contiguous(),
              "int8_linear: scales must be float32 [N]");
  return run(x, packed, pick(false, isa), scales.data_ptr<float>(), prefetch);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t isa, int64_t prefetch) {
  // x [M, K] float32, packed [N / 4, K / 64, INT4_STEP] uint8 -> [M, N] float32
  check_inputs(x, packed, at::kByte, INT4_STEP, isa, prefetch);
  return run(x, packed, pick(true, isa), nullptr, prefetch);
}

}  // namespace

TORCH_LIBRARY(gpt_fast, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales, int isa, int prefetch) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, int isa, int prefetch) -> Tensor");
  m.def("int4_weights(Tensor packed) -> Tensor");
  m.def("half_linear(Tensor x, Tensor weight, int prefetch) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt_fast, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_weights", &int4_weights);
  m.impl("half_linear", &half_linear);
  m.impl("decode_attention", &decode_attention);
}
