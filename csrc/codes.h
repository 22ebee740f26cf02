// The codes and constants that cross the Python / native boundary, defined once: bindings.cpp exports
// every one of them as an nsa_cp._C attribute and the Python side reads them from there (nsa_cp/transport/
// p2p/buffers.py). The wire formats' traits are defined here and in nsa_cp/geometry/wire.py; the P2P transport
// checks that the two agree when it is made.
#pragma once

namespace nsa_cp {

// _C.DTYPE_*: the element type of rows and norm weights.
enum DType : int { kBF16 = 0, kFP16 = 1, kFP32 = 2 };

// ---- wire formats ---------------------------------------------------------------------------------
// A format's traits: per row, groups of kGroup columns; amax = max |y| clamped to >= kAmaxFloor;
// scale = amax / kMax (correctly rounded), then >= kScaleFloor, then, kPow2Scales, rounded UP to a power
// of two (exactly: the next power of two unless it is one); q = clamp(y / scale, +-kMax) as float8_e4m3fn;
// one fp32 scale per group. kCode (< 8) rides in the call fingerprint. The kernels are templated on
// these structs (p2p_gather.cu); adding a format is a struct here and a row in WireFormats below.
struct NoQuant {
  static constexpr const char* kName = "QUANT_NONE";
  static constexpr int kCode = 0;
  static constexpr int kGroup = 1;
  static constexpr float kMax = 0.0f;
  static constexpr float kAmaxFloor = 0.0f;
  static constexpr float kScaleFloor = 0.0f;
  static constexpr bool kPow2Scales = false;
};

// float8_e4m3fn in groups of 128 columns, what both FP8 formats share.
struct E4m3G128 {
  static constexpr int kGroup = 128;
  static constexpr float kMax = 448.0f;
  static constexpr float kAmaxFloor = 1e-10f;
};

// fp8_e4m3_g128: SGLang's per_token_group_quant_fp8 (fp32 scales as they come).
struct Fp8E4m3G128 : E4m3G128 {
  static constexpr const char* kName = "QUANT_FP8_E4M3_G128";
  static constexpr int kCode = 1;
  static constexpr float kScaleFloor = 0.0f;
  static constexpr bool kPow2Scales = false;
};

// fp8_e4m3_g128_ue8m0: vLLM's per_token_group_quant_fp8 with use_ue8m0 (DeepGEMM's power-of-two scales).
struct Fp8E4m3G128Ue8m0 : E4m3G128 {
  static constexpr const char* kName = "QUANT_FP8_E4M3_G128_UE8M0";
  static constexpr int kCode = 2;
  static constexpr float kScaleFloor = 1e-10f;
  static constexpr bool kPow2Scales = true;
};

template <class... F>
struct FormatList {
  static_assert(((F::kCode >= 0 && F::kCode < 8) && ...), "a format's code must fit the fingerprint's 3 bits");
};
// Every format the P2P kernels are built for (NoQuant first).
using WireFormats = FormatList<NoQuant, Fp8E4m3G128, Fp8E4m3G128Ue8m0>;

// _C.QUANT_*: each format's code under its name; _C.WIRE_FORMATS: every format's traits, which the
// Python side compares with its own (nsa_cp/geometry/wire.py). group: columns per scale (1 for none).
struct QuantCode {
  const char* name;
  int code;
  int group;
  float max;
  float amax_floor;
  float scale_floor;
  bool pow2_scales;
};
template <class... F>
constexpr int format_count(FormatList<F...>) {
  return static_cast<int>(sizeof...(F));
}
template <class... F>
struct QuantCodeTable {
  static constexpr QuantCode kRows[] = {{F::kName, F::kCode, F::kGroup, F::kMax, F::kAmaxFloor, F::kScaleFloor, F::kPow2Scales}...};
};
template <class... F>
constexpr const QuantCode* quant_code_rows(FormatList<F...>) {
  return QuantCodeTable<F...>::kRows;
}
constexpr int kQuantCount = format_count(WireFormats{});
constexpr const QuantCode* kQuantCodes = quant_code_rows(WireFormats{});

// Columns per scale of the wire format `code`; 0 for a code that is none of WireFormats.
inline int quant_group(int code) {
  for (int i = 0; i < kQuantCount; ++i) {
    if (kQuantCodes[i].code == code) return kQuantCodes[i].group;
  }
  return 0;
}

// Calls f(F{}) for the format whose code is `code` (false when none is).
template <class Fn, class... F>
bool with_format(int code, Fn&& f, FormatList<F...>) {
  return ((F::kCode == code ? (f(F{}), true) : false) || ...);
}
template <class Fn>
bool with_format(int code, Fn&& f) {
  return with_format(code, static_cast<Fn&&>(f), WireFormats{});
}

}  // namespace nsa_cp
