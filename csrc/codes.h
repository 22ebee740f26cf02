// The codes and constants that cross the Python / native boundary, defined once: bindings.cpp exports
// every one of them as an nsa_cp._C attribute and the Python side reads them from there (nsa_cp/transport/
// p2p/buffers.py, the wire formats of nsa_cp/wire.py are checked against them when the transport is made).
#pragma once

namespace nsa_cp {

// _C.DTYPE_*: the element type of rows and norm weights.
enum DType : int { kBF16 = 0, kFP16 = 1, kFP32 = 2 };

// _C.QUANT_*: a wire format's code (nsa_cp/wire.py, WireFormat.native_code).
enum class Quant : int { kNone = 0, kFp8G128 = 1 };

// fp8_e4m3_g128 (_C.FP8_GROUP, _C.FP8_MAX, _C.FP8_AMAX_FLOOR): one fp32 scale per group of columns.
constexpr int kFp8Group = 128;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8AmaxFloor = 1e-10f;

// Every wire format: its _C attribute name, code and group (columns per scale; 1 for none). bindings.cpp
// exports each one, P2PState checks a call's code and the row length against it.
struct QuantCode {
  const char* name;
  int code;
  int group;
};
constexpr QuantCode kQuantCodes[] = {
    {"QUANT_NONE", static_cast<int>(Quant::kNone), 1},
    {"QUANT_FP8_E4M3_G128", static_cast<int>(Quant::kFp8G128), kFp8Group},
};

// Columns per scale of the wire format `code`; 0 for a code that is none of kQuantCodes.
inline int quant_group(int code) {
  for (const QuantCode& q : kQuantCodes) {
    if (q.code == code) return q.group;
  }
  return 0;
}

}  // namespace nsa_cp
