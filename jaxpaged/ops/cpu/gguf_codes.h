// Reading GGUF block codes into float vectors, and the FFI signature: what gguf_matmul.cc (codes [L, K/32,
// 32 or 16, N]), gguf_panels.cc and gguf_panels_q8.cc (codes in 16-column panels) share.
#pragma once

#include "common.h"

namespace jaxpaged {

// The FFI signature of a matmul over GGUF codes (gguf_matmul, gguf_panels, gguf_panels_q8):
// (x f32, codes u8, scales f32, mins f32, layer s32) -> y f32, on XLA's intra-op thread pool.
inline auto codes_matmul_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::U8>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

// 16 codes as floats. GCC 12 scalarizes __builtin_convertvector from uint8, hence the intrinsics.
inline f32x16 load_codes(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)));
#elif defined(__AVX2__)
  const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
  const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  f32x16 v;
  std::memcpy(&v, &a, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &b, 32);
  return v;
#else
  f32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// 32 codes from 16 packed bytes: the low nibbles (k rows j of a block) and the high (rows j + 16).
inline void load_nibbles(const uint8_t* p, f32x16& low, f32x16& high) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))));
  high = reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)));
#elif defined(__AVX2__)
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i mask = _mm256_set1_epi32(15);
  const __m256 la = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), lb = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
  const __m256 ha = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), hb = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  std::memcpy(&low, &la, 32);
  std::memcpy(reinterpret_cast<char*>(&low) + 32, &lb, 32);
  std::memcpy(&high, &ha, 32);
  std::memcpy(reinterpret_cast<char*>(&high) + 32, &hb, 32);
#else
  for (int i = 0; i < 16; ++i) {
    low[i] = static_cast<float>(p[i] & 15);
    high[i] = static_cast<float>(p[i] >> 4);
  }
#endif
}

}  // namespace jaxpaged
