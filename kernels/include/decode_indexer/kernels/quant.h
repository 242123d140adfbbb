// The quantizers of spec section 2, shared verbatim by the CPU reference and the CUDA kernels
// so that both produce the same codes bit for bit. Everything here is plain integer and float
// bit manipulation: no log2/ldexp (whose rounding could differ between host libm and device
// code), no std:: containers, no exceptions.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DI_HOST_DEVICE __host__ __device__
#else
#define DI_HOST_DEVICE
#endif

namespace decode_indexer::kernels {

DI_HOST_DEVICE inline uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

DI_HOST_DEVICE inline float BitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// The largest finite e4m3 magnitude, and the floor on amax before deriving a scale.
inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE2M1Max = 6.0f;
inline constexpr float kAmaxFloor = 1e-4f;

// float -> e4m3 (OCP "FN": bias 7, no infinities, 0x7F is NaN). Round to nearest even on the
// float's exact value; magnitudes >= 448 saturate to 448 (0x7E); subnormals (m * 2^-9) are
// produced correctly. NaN maps to 0x7F (never produced from valid input).
DI_HOST_DEVICE inline uint8_t EncodeE4M3(float x) {
  const uint32_t bits = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abits = bits & 0x7FFFFFFFu;
  if (abits > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);   // NaN
  if (abits >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7Eu);  // >= 448 (and inf)
  const int32_t exp_field = static_cast<int32_t>(abits >> 23);
  if (exp_field == 0) return sign;  // zero or float subnormal: far below 2^-10
  const int32_t e = exp_field - 127;
  const uint32_t mant = abits & 0x7FFFFFu;
  if (e >= -6) {
    // Normal e4m3: keep 3 of the 23 mantissa bits, round to nearest even. A carry out of the
    // mantissa bumps the exponent, which the packed encoding does by plain addition.
    uint32_t code = (static_cast<uint32_t>(e + 7) << 3) | (mant >> 20);
    const uint32_t rest = mant & 0xFFFFFu;
    const uint32_t half = 0x80000u;
    if (rest > half || (rest == half && (code & 1u))) ++code;
    return static_cast<uint8_t>(sign | code);
  }
  if (e < -10) return sign;  // below 2^-10: rounds to zero
  // Subnormal e4m3: the value in units of 2^-9 is full >> (14 - e); round to nearest even.
  // A round-up to 8 units is exactly the smallest normal (code 0x08).
  const uint32_t full = mant | 0x800000u;
  const int32_t shift = 14 - e;  // 21 .. 24
  uint32_t code = full >> shift;
  const uint32_t rest = full & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (code & 1u))) ++code;
  return static_cast<uint8_t>(sign | code);
}

DI_HOST_DEVICE inline float DecodeE4M3(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t e = (code >> 3) & 0xFu;
  const uint32_t m = code & 0x7u;
  if (e == 15 && m == 7) return BitsFloat(sign | 0x7FC00000u);  // NaN
  if (e == 0) {
    // m * 2^-9, exact in float.
    return BitsFloat(sign | FloatBits(static_cast<float>(m) * (1.0f / 512.0f)));
  }
  return BitsFloat(sign | ((e - 7u + 127u) << 23) | (m << 20));
}

// float -> e2m1 nibble: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are codes 0..7 (even code = even
// mantissa), sign in bit 3. Round to nearest, ties to the even code; saturates at 6.
DI_HOST_DEVICE inline uint8_t EncodeE2M1(float x) {
  const uint32_t bits = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 28) & 0x8u);
  const float a = BitsFloat(bits & 0x7FFFFFFFu);
  uint8_t code;
  if (a <= 0.25f) {
    code = 0;
  } else if (a < 0.75f) {
    code = 1;
  } else if (a <= 1.25f) {
    code = 2;
  } else if (a < 1.75f) {
    code = 3;
  } else if (a <= 2.5f) {
    code = 4;
  } else if (a < 3.5f) {
    code = 5;
  } else if (a <= 5.0f) {
    code = 6;
  } else {
    code = 7;  // (5, inf]; NaN never occurs in valid input
  }
  return static_cast<uint8_t>(sign | code);
}

DI_HOST_DEVICE inline float DecodeE2M1(uint8_t nibble) {
  // Magnitude of code c: c < 2: c / 2; else (2 + (c & 1)) * 2^((c >> 1) - 2), written out.
  const uint8_t c = nibble & 0x7u;
  float mag;
  switch (c) {
    case 0:
      mag = 0.0f;
      break;
    case 1:
      mag = 0.5f;
      break;
    case 2:
      mag = 1.0f;
      break;
    case 3:
      mag = 1.5f;
      break;
    case 4:
      mag = 2.0f;
      break;
    case 5:
      mag = 3.0f;
      break;
    case 6:
      mag = 4.0f;
      break;
    default:
      mag = 6.0f;
      break;
  }
  return (nibble & 0x8u) ? -mag : mag;
}

// ue8m0: a biased power-of-two exponent byte, value 2^(byte - 127). 0 is 2^-127 (a float
// subnormal); 255 is NaN. Scales in this service stay far inside the normal range.
DI_HOST_DEVICE inline float DecodeUE8M0(uint8_t byte) {
  if (byte == 0) return BitsFloat(0x00400000u);  // 2^-127
  if (byte == 255) return BitsFloat(0x7FC00000u);
  return BitsFloat(static_cast<uint32_t>(byte) << 23);
}

// The exponent byte of a normal power-of-two float (the encoding of the scales made below).
DI_HOST_DEVICE inline uint8_t EncodeUE8M0(float power_of_two) {
  return static_cast<uint8_t>((FloatBits(power_of_two) >> 23) & 0xFFu);
}

// 2^ceil(log2(x)) for a positive normal float x, exactly: x itself when it is a power of two,
// else the next power of two. Done on the bits because log2() rounds.
DI_HOST_DEVICE inline float CeilPow2(float x) {
  const uint32_t bits = FloatBits(x);
  uint32_t exp_field = (bits >> 23) & 0xFFu;
  if (bits & 0x7FFFFFu) ++exp_field;
  return BitsFloat(exp_field << 23);
}

// FP8 per-vector scale: s = 2^ceil(log2(max(amax, 1e-4) / 448)). The quotient is rounded to
// float first, as the reference code does; for the divisor 448 that rounding can never move
// it onto or off a power of two, so the result equals the exact-arithmetic one.
DI_HOST_DEVICE inline float Fp8Scale(float amax) {
  const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
  return CeilPow2(a / kE4M3Max);
}

// MXFP4 per-32 scale: s = 2^ceil(log2(max(amax, 1e-4) / 6)); stored as EncodeUE8M0(s).
DI_HOST_DEVICE inline float Fp4Scale(float amax) {
  const float a = amax > kAmaxFloor ? amax : kAmaxFloor;
  return CeilPow2(a / kE2M1Max);
}

DI_HOST_DEVICE inline float BF16ToFloat(uint16_t bf16) {
  return BitsFloat(static_cast<uint32_t>(bf16) << 16);
}

// Packed FP4 access: element 2i in the low nibble of byte i, element 2i+1 in the high nibble.
DI_HOST_DEVICE inline uint8_t Fp4Nibble(const uint8_t* packed, int32_t index) {
  const uint8_t byte = packed[index >> 1];
  return (index & 1) ? static_cast<uint8_t>(byte >> 4) : static_cast<uint8_t>(byte & 0xFu);
}

DI_HOST_DEVICE inline uint8_t PackFp4(uint8_t low_nibble, uint8_t high_nibble) {
  return static_cast<uint8_t>((low_nibble & 0xFu) | ((high_nibble & 0xFu) << 4));
}

}  // namespace decode_indexer::kernels
