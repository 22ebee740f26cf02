// Host entry points of nsa_cp._C, as bindings.cpp sees them.
//
// Deliberately free of CUDA and torch headers: every device address, the signal pads and the stream
// are plain integers (uint64), so one compiled module serves any torch build. Argument meanings and
// units are documented on the Python side, in bindings.cpp.
//
// Every launcher validates its arguments before any CUDA call and throws std::invalid_argument
// (Python ValueError) on a bad one; CUDA failures throw std::runtime_error (Python RuntimeError)
// carrying the CUDA error string.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace nsa_cp {

constexpr int kMaxWorld = 8;

// err[0] codes of the error record (see common.cuh for the whole record).
constexpr uint32_t kErrNone = 0;
constexpr uint32_t kErrTimeout = 1;
// A device-side argument was unusable (counts out of range, offsets not the prefix sum, a null or
// misaligned buffer). The kernel then skips its data movement but still completes the protocol.
constexpr uint32_t kErrBadDeviceArg = 2;
// An ordered call read a position outside [0, T): the row went to (or came from) the clamped row,
// never outside the buffers; the results of that call are wrong.
constexpr uint32_t kErrBadPosition = 3;
// Two ranks entered the same call assuming different things (the fingerprint of common.cuh: layout
// counts, max_rank_len, rows in total, row bytes, compact / ordered / norm / wire format, call number). The
// reduce-scatter reads no row of that call; the gather moves none when it had an entry exchange, and
// otherwise overwrites its own result with NaN bytes before the launch ends.
constexpr uint32_t kErrLayoutMismatch = 4;
// uint32 words of the error record: [code, channel*2 + phase, rank, epoch] and, for a layout
// mismatch, [own hash, own desc, peer hash, peer desc, peer epoch] (then 3 unused words).
constexpr int kErrRecordWords = 12;

// The signal pad: uint32 words per rank (nsa_cp.geometry.workspace.SIGNAL_WORDS allocates this many). Epoch
// slots [(channel*2 + phase)*world + src] below kDoneBase; the gather's done counters
// [kDoneBase + channel*kMaxWorld + src] from there; the call fingerprints [kFpBase + ((channel*2 +
// epoch parity)*kMaxWorld + src)*kFpWords + i] after them (see common.cuh).
constexpr int kSignalWords = 256;
constexpr int kDoneBase = 128;
constexpr int kFpBase = 160;
constexpr int kFpWords = 3;  // hash, desc, epoch
static_assert(kFpBase >= kDoneBase + 2 * kMaxWorld && kFpBase + 4 * kMaxWorld * kFpWords <= kSignalWords,
              "the fingerprint slots of both channels fit the pad after the done counters");
// What one gather launch adds to each rank's done counter, in per-block shares (> kMaxBlocks: every
// share >= 1).
constexpr uint32_t kDoneQuantum = 1u << 16;

// Threads per block of the data-movement kernels (p2p_gather, p2p_reduce_scatter).
constexpr int kDataThreads = 512;
// The arrive counter keeps the block count in 16 bits (see common.cuh).
constexpr int kMaxBlocks = 65535;
static_assert(kDoneQuantum > static_cast<uint32_t>(kMaxBlocks), "every block's done share must be >= 1");

// ---- barrier.cu -------------------------------------------------------------------------------
void barrier(uint64_t pads, int rank, int world, int channel, int phase, uint64_t seq, bool advance,
             uint64_t timeout_ns, uint64_t err, uint64_t stream);
// The same barrier carrying a host-computed call fingerprint (fp_on): published with the signal,
// compared with every peer's after the wait (a mismatch sets kErrLayoutMismatch).
void barrier_fingerprinted(uint64_t pads, int rank, int world, int channel, int phase, uint64_t seq, bool advance,
                           uint64_t timeout_ns, uint64_t err, uint64_t stream, bool fp_on, uint32_t fp_hash,
                           uint32_t fp_desc);
// Overwrites bytes [ptr, ptr + bytes) with 0xFF (NaN for every float dtype) when, as the kernel runs, the
// error record err[0] is set; otherwise writes nothing.
void poison_on_error(uint64_t err, uint64_t ptr, int64_t bytes, uint64_t stream);

// ---- p2p_gather.cu ----------------------------------------------------------------------------
// p2p_gather / p2p_reduce_scatter: the stateless launchers, for the native layer's tests only (the
// transport launches through P2PState); barrier also serves P2PState.
void p2p_gather(uint64_t src, int64_t src_row_stride_bytes, int64_t row_bytes, uint64_t bufs, uint64_t counts,
                uint64_t offsets, int64_t max_rank_len, bool compact, int rank, int world, uint64_t pads,
                int channel, uint64_t seq, uint64_t arrive, uint64_t timeout_ns, uint64_t err, int num_blocks,
                uint64_t stream, int buffer, uint64_t state);

// ---- p2p_reduce_scatter.cu --------------------------------------------------------------------
void p2p_reduce_scatter(uint64_t out, int64_t out_row_stride_bytes, uint64_t bufs, uint64_t counts,
                        uint64_t offsets, int64_t max_rank_len, bool compact, int64_t hidden, int dtype, int rank,
                        int world, uint64_t pads, int channel, uint64_t seq, uint64_t arrive, uint64_t timeout_ns,
                        uint64_t err, int num_blocks, uint64_t stream);

// ---- p2p_state.cu: the P2P transport's native state, bound once --------------------------------
// What a launch raises when the transport's host-mapped error record already holds an error (an
// earlier call timed out or rejected its device-side geometry): the launch enqueued nothing. Python:
// nsa_cp._C.P2PDeviceError (a RuntimeError); the transport turns it into P2PError / P2PTimeoutError.
class P2PDeviceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct SignalArgs;  // common.cuh, p2p_kernels.h: what the kernels take
struct GatherParams;
struct ReduceParams;

// Everything fixed for the life of one rank's P2P transport, by name (field meanings: bindings.cpp,
// P2PConfig). The Python transport fills one and hands it to P2PState, which checks it once.
struct P2PConfig {
  int device = 0;
  int rank = 0;
  int world = 0;
  uint64_t gather_ptrs = 0;   // device uint64[2][world]: every rank's gather buffer 0, then 1
  uint64_t reduce_ptrs = 0;   // device uint64[world]: every rank's reduce buffer
  uint64_t pads = 0;          // device uint64[world]: every rank's signal pad
  uint64_t seq = 0;           // device uint32[2] epochs (gather, reduce-scatter channel)
  uint64_t arrive = 0;        // device uint32[2] finished-block counters
  uint64_t gather_state = 0;  // device uint32[2]: the buffer the last gather wrote, done total consumed
  uint64_t err_host = 0;      // the host-mapped error record, host and device address
  uint64_t err_dev = 0;
  uint64_t timeout_ns = 0;    // 0: wait forever
  int64_t hidden = 0;         // elements per row
  int dtype = 0;              // kBF16 / kFP16 / kFP32
  int sm_count = 0;           // block policy
  int64_t max_rows_per_rank = 0;   // rows per rank of gather buffer 0 and the reduce buffer
  int64_t double_buffer_rows = 0;  // rows per rank of gather buffer 1 (0: none)
  bool check_layout = true;        // carry and compare the call fingerprint (common.cuh)
};

// One rank's P2P transport state (DeepEP's Buffer idea): checked once at construction; a launch then
// passes only what changes per call and checks only that. The gather's double-buffer choice lives here.
class P2PState {
 public:
  explicit P2PState(const P2PConfig& config);

  // Each returns the gather buffer it wrote (0 or 1).
  int gather(uint64_t src, int64_t src_row_stride_bytes, uint64_t counts, uint64_t offsets, int64_t max_rank_len,
             bool compact, uint64_t stream, uint64_t positions, int64_t num_positions);
  int norm_gather(uint64_t x, int64_t x_row_stride_bytes, uint64_t residual, int64_t residual_row_stride_bytes,
                  uint64_t weight, int weight_dtype, double eps, bool norm, int quant, uint64_t counts,
                  uint64_t offsets, int64_t max_rank_len, bool compact, uint64_t stream, uint64_t positions,
                  int64_t num_positions);
  void reduce_scatter(uint64_t out, int64_t out_row_stride_bytes, uint64_t counts, uint64_t offsets,
                      int64_t max_rank_len, bool compact, uint64_t stream, uint64_t positions, int64_t num_positions);
  // The reduce-scatter with the add + RMSNorm epilogue (p2p_kernels.h, NormEpilogue): out = the normed
  // rows, residual updated in place.
  void reduce_scatter_norm(uint64_t out, int64_t out_row_stride_bytes, uint64_t residual,
                           int64_t residual_row_stride_bytes, uint64_t weight, int weight_dtype, double eps,
                           uint64_t counts, uint64_t offsets, int64_t max_rank_len, bool compact, uint64_t stream,
                           uint64_t positions, int64_t num_positions);
  void barrier(uint64_t stream);
  // The copy engine's gather (transfers the caller makes between the two): entry barrier; done
  // barrier, then the record that buffer 0 was written last.
  void copy_engine_begin(uint64_t stream);
  void copy_engine_end(uint64_t stream);
  // The overlapped boundary's pulls: copy_engine_begin carrying the host's call fingerprint (hash, desc:
  // common.cuh's CallFingerprint; compared when check_layout); copy_engine_end closes the call.
  void pull_begin(uint64_t stream, uint32_t fp_hash, uint32_t fp_desc);
  // [ptr, ptr + bytes) <- NaN bytes if the error record is set when the kernel runs (runs even when it
  // is already set: the result of a call already begun must not look valid).
  void poison_on_error(uint64_t ptr, int64_t bytes, uint64_t stream);

  std::vector<uint32_t> error() const;  // the error record, err[0..kErrRecordWords)
  // After close() every method that touches device or host-mapped memory raises RuntimeError: the
  // owner frees the error record and the buffers after calling it.
  void close() { closed_ = true; }
  bool closed() const { return closed_; }
  int64_t gather_rows(int buffer) const;  // capacity rows of gather buffer `buffer`
  int64_t scale_offset(int buffer) const;  // fp8: byte offset of the scale block in that buffer
  int last_buffer() const { return last_buffer_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  int64_t hidden() const { return hidden_; }
  int64_t row_bytes() const { return row_bytes_; }
  int64_t max_rows_per_rank() const { return max_rows_; }
  int64_t double_buffer_rows() const { return double_rows_; }
  bool check_layout() const { return check_layout_; }

 private:
  void check_error_record(const char* fn) const;
  void check_call(const char* fn, uint64_t counts, uint64_t offsets, int64_t max_rank_len, bool compact,
                  uint64_t positions, int64_t num_positions) const;
  int next_buffer(int64_t max_rank_len);
  uint32_t fingerprint_flags(bool compact, bool ordered, uint32_t stage) const;  // GatherParams::fp_flags
  SignalArgs signals(int channel) const;
  GatherParams gather_params(int buffer, uint64_t counts, uint64_t offsets, int64_t max_rank_len, bool compact,
                             uint64_t positions, int64_t num_positions, uint32_t stage) const;
  ReduceParams reduce_params(uint64_t out, int64_t out_row_stride_bytes, uint64_t counts, uint64_t offsets,
                             int64_t max_rank_len, bool compact, uint64_t positions, int64_t num_positions,
                             uint32_t stage) const;
  int data_blocks(int64_t max_rank_len) const;
  int row_blocks(int64_t max_rank_len) const;
  int norm_words_per_thread(const char* fn) const;
  void check_norm_rows(const char* fn, const char* name, uint64_t ptr, int64_t stride, int64_t max_rank_len) const;
  void check_weight(const char* fn, uint64_t weight, int weight_dtype, double eps) const;

  int device_, rank_, world_, dtype_, sm_count_;
  uint64_t gather_ptrs_, reduce_ptrs_, pads_, seq_, arrive_, gather_state_, err_host_, err_dev_, timeout_ns_;
  int64_t hidden_, row_bytes_, max_rows_, double_rows_;
  bool check_layout_ = true;  // carry and compare the call fingerprint (common.cuh) on every launch
  bool closed_ = false;
  int last_buffer_ = 0;  // the host's record of the buffer the last gather wrote (the device keeps its own)
};

// ---- row_copy.cu (the NCCL path's layout conversions; no signal protocol) -----------------------
void pack_rows(uint64_t src, int64_t src_row_stride_bytes, int64_t src_rows, uint64_t dst,
               int64_t dst_row_stride_bytes, int64_t dst_rows, int64_t row_bytes, uint64_t count, uint64_t stream);
void padded_compact(uint64_t padded, int64_t padded_row_stride_bytes, uint64_t compact,
                    int64_t compact_row_stride_bytes, int64_t compact_rows, int64_t row_bytes, uint64_t counts,
                    uint64_t offsets, int64_t max_rank_len, int world, bool to_compact, uint64_t stream);

// ---- nccl_comm.cu: an NCCL communicator owned by the module (libnccl opened at run time) ---------
constexpr int kNcclUniqueIdBytes = 128;  // sizeof(ncclUniqueId)
// library: a path to libnccl, or "" for the copy already loaded in the process (torch's), else the
// loader's libnccl.so.2. The first call opens it for the life of the process.
std::string nccl_library(const std::string& library);  // the library opened (its path or soname)
int nccl_version(const std::string& library);          // ncclGetVersion, e.g. 22809
std::string nccl_unique_id(const std::string& library);  // kNcclUniqueIdBytes bytes

// One rank's communicator. Collectives enqueue on `stream` and return; counts are elements of the
// ncclDataType_t `dtype`. Bad arguments: std::invalid_argument before any NCCL call; NCCL failures:
// std::runtime_error with NCCL's error string.
class NcclComm {
 public:
  NcclComm(const std::string& unique_id, int world, int rank, int device, const std::string& library);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  void all_gather(uint64_t send, uint64_t recv, int64_t count, int dtype, uint64_t stream);
  // pack_rows into our slot (rows [rank*rows_per_rank, ...) of the dense recv), then the in-place
  // all-gather of rows_per_rank rows per rank: the padded gather in one host call.
  void pack_all_gather(uint64_t src, int64_t src_row_stride_bytes, int64_t src_rows, uint64_t recv,
                       int64_t rows_per_rank, int64_t row_bytes, uint64_t count, uint64_t stream);
  void reduce_scatter(uint64_t send, uint64_t recv, int64_t count, int dtype, uint64_t stream);
  // Uneven: rank q's counts[q] elements at recv + offsets[q] (elements of elem_bytes) - grouped
  // broadcasts (all_gather_v) / grouped reduces rooted at each rank (reduce_scatter_v).
  void all_gather_v(uint64_t send, uint64_t recv, const std::vector<int64_t>& counts,
                    const std::vector<int64_t>& offsets, int dtype, int64_t elem_bytes, uint64_t stream);
  void reduce_scatter_v(uint64_t send, uint64_t recv, const std::vector<int64_t>& counts,
                        const std::vector<int64_t>& offsets, int dtype, int64_t elem_bytes, uint64_t stream);
  std::string async_error() const;  // "" while healthy
  void close(bool abort);           // collective (destroy) unless abort; idempotent
  bool closed() const { return comm_ == nullptr; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }

 private:
  void* live(const char* fn) const;
  void* comm_ = nullptr;
  int world_, rank_, device_;
};

// ---- runtime.cu: queries and host-mapped memory -----------------------------------------------
int device_count();                 // 0 when there is no driver or no device; throws on other errors
std::string device_status();        // "ok", or why device_count() is 0 / failed ("cudaErrorNoDevice: ...")
bool can_access_peer(int device, int peer);
void enable_peer_access(int device, int peer);  // kernels on `device` may touch `peer`'s memory; idempotent
std::pair<uint64_t, uint64_t> alloc_host_mapped_u32(int64_t n);  // (host pointer, device pointer), zeroed
void free_host_mapped(uint64_t host_ptr);
uint32_t read_u32(uint64_t host_ptr, int64_t index);
void write_u32(uint64_t host_ptr, int64_t index, uint32_t value);
int runtime_version();              // CUDA runtime linked in (e.g. 13000)
int driver_version();               // 0 without a driver

struct KernelInfo {
  std::string name;
  int num_regs;
  int local_bytes;      // stack frame / spill space per thread
  int shared_bytes;     // static shared memory per block
  int max_threads;
  int binary_version;   // arch of the loaded machine code, e.g. 90
  int ptx_version;      // virtual arch it was compiled from, e.g. 90
};
// Loads every kernel of the module (do it before CUDA-graph capture) and reports its attributes.
std::vector<KernelInfo> kernel_info();

}  // namespace nsa_cp
