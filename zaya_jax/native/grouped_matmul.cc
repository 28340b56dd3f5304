// Grouped (ragged) matmul for XLA:CPU through the typed FFI, each expert's exact rows on BLAS sgemm.
//
// Rows of `lhs` are sorted by group: group e owns rows [start_e, start_e + n_e), start_e = n_0 + ... + n_{e-1}.
// Group sizes are clipped so that no group reaches past row T; rows past their sum get zeros.
//   zaya_grouped_matmul               lhs [T,K], rhs [E,K,N], sizes [E] -> out [T,N]  out_e = lhs_e @ rhs[e]
//   zaya_grouped_matmul_transposed    lhs [T,N], rhs [E,K,N], sizes [E] -> out [T,K]  out_e = lhs_e @ rhs[e]^T
//   zaya_grouped_matmul_rhs_grad      lhs [T,K], dout [T,N], sizes [E] -> out [E,K,N] out[e] = lhs_e^T @ dout_e
//                                     (0 for an empty group)
// float32 and bfloat16 (bfloat16 operands are widened to float32 around sgemm and the result rounded
// to nearest even). Threads: the work is cut into units (an expert's block of rows, or of weight-gradient
// columns) that XLA's own intra-op thread pool and the calling thread take in turn, each unit one
// single-threaded sgemm (OpenBLAS's pool spinning beside XLA's oversubscribes the cores).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "cblas.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

float BF16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t F32ToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The first `count` elements of a float32 or bfloat16 buffer as float32 (bfloat16 is copied).
class F32Input {
 public:
  F32Input(const ffi::AnyBuffer& buf, int64_t count) {
    if (buf.element_type() == ffi::DataType::F32) {
      data_ = static_cast<const float*>(buf.untyped_data());
      return;
    }
    const uint16_t* src = static_cast<const uint16_t*>(buf.untyped_data());
    copy_.resize(count);
    for (int64_t i = 0; i < count; ++i) copy_[i] = BF16ToF32(src[i]);
    data_ = copy_.data();
  }
  const float* data() const { return data_; }

 private:
  const float* data_ = nullptr;
  std::vector<float> copy_;
};

// A float32 view of an output buffer; bfloat16 outputs are written back rounded by Finish().
class F32Output {
 public:
  explicit F32Output(ffi::AnyBuffer* buf) : buf_(buf) {
    int64_t count = static_cast<int64_t>(buf->element_count());
    if (buf->element_type() == ffi::DataType::F32) {
      data_ = static_cast<float*>(buf->untyped_data());
    } else {
      copy_.assign(count, 0.0f);
      data_ = copy_.data();
    }
  }
  float* data() { return data_; }
  void Finish(int64_t count) {
    if (copy_.empty()) return;
    uint16_t* dst = static_cast<uint16_t*>(buf_->untyped_data());
    for (int64_t i = 0; i < count; ++i) dst[i] = F32ToBF16(copy_[i]);
  }

 private:
  ffi::AnyBuffer* buf_;
  float* data_ = nullptr;
  std::vector<float> copy_;
};

// Runs fn(0) ... fn(count - 1) on the calling thread and up to pool.num_threads() helpers. Helpers take
// units from a shared counter, so one that starts late (its pool busy) finds none left and returns;
// the caller waits only for units that were taken, never for a helper to start.
class ParallelFor {
 public:
  static void Run(ffi::ThreadPool& pool, int64_t count, std::function<void(int64_t)> fn) {
    auto state = std::make_shared<State>(count, std::move(fn));
    int64_t helpers = std::min<int64_t>(pool.num_threads(), count - 1);
    for (int64_t h = 0; h < helpers; ++h) pool.Schedule([state] { Drain(*state); });
    Drain(*state);
    std::unique_lock<std::mutex> lock(state->mu);
    state->all_done.wait(lock, [&] { return state->done == state->count; });
  }

 private:
  struct State {
    State(int64_t n, std::function<void(int64_t)> f) : count(n), fn(std::move(f)) {}
    const int64_t count;
    std::function<void(int64_t)> fn;
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable all_done;
    int64_t done = 0;
  };

  static void Drain(State& s) {
    int64_t finished = 0;
    for (int64_t i; (i = s.next.fetch_add(1)) < s.count; ++finished) s.fn(i);
    if (finished == 0) return;
    std::lock_guard<std::mutex> lock(s.mu);
    s.done += finished;
    if (s.done == s.count) s.all_done.notify_all();
  }
};

struct Unit {
  int64_t group, begin, end;  // rows (or columns) [begin, end) of one group
};

// Cuts [0, extent_e) of every non-empty group into pieces of about `target` work, where a piece of
// width w in group e is worth w * weight_e; at least `min_width` wide (the last may be narrower).
std::vector<Unit> Split(const std::vector<int64_t>& n, int64_t extent, bool rows, int64_t pieces_wanted,
                        int64_t min_width) {
  int64_t used = 0;
  for (int64_t s : n) used += s;
  std::vector<Unit> units;
  int64_t start = 0;
  for (size_t e = 0; e < n.size(); ++e) {
    if (n[e] > 0) {
      int64_t len = rows ? n[e] : extent;
      int64_t pieces = std::max<int64_t>(1, (n[e] * pieces_wanted + used - 1) / used);
      int64_t width = std::max(min_width, (len + pieces - 1) / pieces);
      for (int64_t b = 0; b < len; b += width) {
        int64_t offset = rows ? start : 0;
        units.push_back({static_cast<int64_t>(e), offset + b, offset + std::min(len, b + width)});
      }
    }
    start += n[e];
  }
  return units;
}

constexpr int64_t kUnitsPerThread = 4;
constexpr int64_t kMinRows = 32;
constexpr int64_t kMinColumns = 64;

// sizes clipped to [0, rows left], so that the groups cover at most `rows` rows.
std::vector<int64_t> ClippedSizes(const ffi::Buffer<ffi::S32>& sizes, int64_t rows) {
  const int32_t* n = sizes.typed_data();
  std::vector<int64_t> out(sizes.element_count());
  int64_t left = rows;
  for (size_t e = 0; e < out.size(); ++e) {
    out[e] = std::min<int64_t>(std::max<int32_t>(n[e], 0), left);
    left -= out[e];
  }
  return out;
}

ffi::Error CheckDtypes(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& out) {
  ffi::DataType t = a.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("grouped matmul takes float32 or bfloat16 operands");
  if (b.element_type() != t || out.element_type() != t)
    return ffi::Error::InvalidArgument("grouped matmul operands and result must share one dtype");
  return ffi::Error::Success();
}

// out [T, cols] = per group: lhs rows [n_e, inner] times rhs[e] ([inner, cols], or [cols, inner] transposed).
template <bool kTransposeRhs>
ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                         ffi::Result<ffi::AnyBuffer> out) {
  if (ffi::Error err = CheckDtypes(lhs, rhs, *out); err.failure()) return err;
  auto ld = lhs.dimensions(), rd = rhs.dimensions();
  if (ld.size() != 2 || rd.size() != 3 || sizes.element_count() != static_cast<size_t>(rd[0]))
    return ffi::Error::InvalidArgument("grouped matmul wants lhs [T,K], rhs [E,K,N], group_sizes [E]");
  const int64_t rows = ld[0], inner = ld[1];
  const int64_t cols = kTransposeRhs ? rd[1] : rd[2];
  if ((kTransposeRhs ? rd[2] : rd[1]) != inner)
    return ffi::Error::InvalidArgument("grouped matmul: lhs and rhs contraction sizes differ");
  std::vector<int64_t> n = ClippedSizes(sizes, rows);
  int64_t used = 0;
  for (int64_t s : n) used += s;
  F32Input a(lhs, used * inner);
  F32Input b(rhs, static_cast<int64_t>(rhs.element_count()));
  F32Output c(&*out);
  float* c_data = c.data();
  std::fill(c_data + used * cols, c_data + rows * cols, 0.0f);
  std::vector<Unit> units = Split(n, cols, /*rows=*/true, kUnitsPerThread * (pool.num_threads() + 1), kMinRows);
  ParallelFor::Run(pool, static_cast<int64_t>(units.size()), [&](int64_t u) {
    const Unit& unit = units[u];
    const float* b_e = b.data() + unit.group * inner * cols;
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, kTransposeRhs ? CblasTrans : CblasNoTrans, unit.end - unit.begin,
                      cols, inner, 1.0f, a.data() + unit.begin * inner, inner, b_e, kTransposeRhs ? inner : cols,
                      0.0f, c_data + unit.begin * cols, cols);
  });
  c.Finish(rows * cols);
  return ffi::Error::Success();
}

// out [E, K, N]: out[e] = lhs rows of e [n_e, K] transposed times dout rows of e [n_e, N].
ffi::Error GroupedMatmulRhsGrad(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer dout, ffi::Buffer<ffi::S32> sizes,
                                ffi::Result<ffi::AnyBuffer> out) {
  if (ffi::Error err = CheckDtypes(lhs, dout, *out); err.failure()) return err;
  auto ld = lhs.dimensions(), dd = dout.dimensions(), od = out->dimensions();
  if (ld.size() != 2 || dd.size() != 2 || od.size() != 3 || ld[0] != dd[0] || od[1] != ld[1] || od[2] != dd[1] ||
      sizes.element_count() != static_cast<size_t>(od[0]))
    return ffi::Error::InvalidArgument("grouped matmul rhs grad wants lhs [T,K], dout [T,N], group_sizes [E]");
  const int64_t rows = ld[0], k = ld[1], cols = dd[1];
  std::vector<int64_t> n = ClippedSizes(sizes, rows);
  int64_t used = 0;
  for (int64_t s : n) used += s;
  F32Input a(lhs, used * k);
  F32Input g(dout, used * cols);
  F32Output c(&*out);
  std::vector<int64_t> start(n.size(), 0);
  for (size_t e = 0; e < n.size(); ++e) {
    if (e > 0) start[e] = start[e - 1] + n[e - 1];
    if (n[e] == 0) std::fill(c.data() + static_cast<int64_t>(e) * k * cols, c.data() + (e + 1) * k * cols, 0.0f);
  }
  std::vector<Unit> units = Split(n, cols, /*rows=*/false, kUnitsPerThread * (pool.num_threads() + 1), kMinColumns);
  ParallelFor::Run(pool, static_cast<int64_t>(units.size()), [&](int64_t u) {
    const Unit& unit = units[u];  // columns [begin, end) of group `group`'s gradient
    int64_t r0 = start[unit.group];
    scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, k, unit.end - unit.begin, n[unit.group], 1.0f,
                      a.data() + r0 * k, k, g.data() + r0 * cols + unit.begin, cols, 0.0f,
                      c.data() + unit.group * k * cols + unit.begin, cols);
  });
  c.Finish(static_cast<int64_t>(n.size()) * k * cols);
  return ffi::Error::Success();
}

}  // namespace

#define ZAYA_GROUPED_BINDING              \
  ffi::Ffi::Bind()                        \
      .Ctx<ffi::ThreadPool>()             \
      .Arg<ffi::AnyBuffer>()              \
      .Arg<ffi::AnyBuffer>()              \
      .Arg<ffi::Buffer<ffi::S32>>()       \
      .Ret<ffi::AnyBuffer>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(zaya_grouped_matmul, GroupedMatmul<false>, ZAYA_GROUPED_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(zaya_grouped_matmul_transposed, GroupedMatmul<true>, ZAYA_GROUPED_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(zaya_grouped_matmul_rhs_grad, GroupedMatmulRhsGrad, ZAYA_GROUPED_BINDING);
