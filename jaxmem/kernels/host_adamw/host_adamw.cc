// One AdamW step over a tensor on the host CPU, in one pass: reads the gradient, the fp32 master weights and
// the fp32 moments once, writes the master and the moments in place and the bf16 params beside them.
// XLA:CPU emits the same update as one loop per output (master, m, v, params), each reading back what the
// previous one wrote; this loop moves each value through memory once and splits the tensor over XLA's
// intra-op thread pool (or threads of its own where the call comes without one). The arithmetic follows
// optax.adamw's order (optax/_src/transform.py):
//   g' = g * multiplier                       (global-norm clip and loss-scale unscale, folded)
//   m' = (1 - b1) g' + b1 m,  v' = (1 - b2) g'^2 + b2 v
//   u  = (m' / bc1) / (sqrt(v' / bc2) + eps) + decay * w,  w' = w - lr u,  p = bf16(w')
// with bc1 = 1 - b1^t and bc2 = 1 - b2^t from the step count. Dividing by bc1 and bc2 is done as a
// multiplication by their reciprocals (one division per value, as torch's fused AdamW), which can move the
// last bit of the fp32 master against optax's three divisions.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Round to nearest even, as XLA's f32 -> bf16 convert; a NaN stays a (quiet) NaN.
inline uint16_t ToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  uint32_t nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline float FromBf16(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

struct Step {
  float lr, inv_bc1, inv_bc2, multiplier;
  float b1, one_minus_b1, b2, one_minus_b2, eps, decay;
};

template <typename G>
void UpdateRange(const G* __restrict grad, float* __restrict w, float* __restrict m, float* __restrict v,
                 uint16_t* __restrict params, const Step& s,
                 int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float g;
    if constexpr (sizeof(G) == 2) {
      g = FromBf16(grad[i]) * s.multiplier;
    } else {
      g = grad[i] * s.multiplier;
    }
    float mi = s.one_minus_b1 * g + s.b1 * m[i];
    float vi = s.one_minus_b2 * (g * g) + s.b2 * v[i];
    float u = (mi * s.inv_bc1) / (std::sqrt(vi * s.inv_bc2) + s.eps) + s.decay * w[i];
    float wi = w[i] - s.lr * u;
    m[i] = mi;
    v[i] = vi;
    w[i] = wi;
    params[i] = ToBf16(wi);
  }
}

void RoundRange(const float* __restrict w, uint16_t* __restrict params, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) params[i] = ToBf16(w[i]);
}

// Runs body(begin, end) over [0, n) in pieces on XLA's intra-op pool and the calling thread; returns when all
// pieces are done. The calling thread takes pieces too and waits only for pieces another thread has started:
// XLA may run this call on a pool thread while the other pool threads are busy (or running another such
// call), so waiting for a scheduled task to start could wait forever. A task that starts after every piece
// is taken finds none and returns; the shared state outlives the call for it. Pieces of at least kMinPiece
// values keep the scheduling cost small beside the memory traffic.
struct Pieces {
  std::atomic<int64_t> next{0};
  int64_t count = 0, per = 0, n = 0;
  int64_t done = 0;
  std::mutex mu;
  std::condition_variable all_done;
};

template <typename Body>
void RunPieces(Pieces& s, const Body& body) {
  for (int64_t p = s.next.fetch_add(1); p < s.count; p = s.next.fetch_add(1)) {
    body(p * s.per, std::min(s.n, (p + 1) * s.per));
    std::lock_guard<std::mutex> lock(s.mu);
    if (++s.done == s.count) s.all_done.notify_all();
  }
}

// Threads of our own where the call has no intra-op pool (a host program run by another XLA client may pass
// none: its pool then reports 0 threads) or JAXMEM_HOST_ADAMW_THREADS asks for a count; 0 keeps XLA's pool.
constexpr int64_t kMinPiece = 1 << 16;  // values: the scheduling cost stays small beside the memory traffic

int64_t OwnThreads(int64_t pool_threads) {
  const char* asked = std::getenv("JAXMEM_HOST_ADAMW_THREADS");
  if (asked != nullptr && std::atoll(asked) > 0) return std::atoll(asked);
  if (pool_threads > 0) return 0;
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const Body& body, int64_t min_piece = kMinPiece) {
  const int64_t own = OwnThreads(pool.num_threads());
  const int64_t workers = own > 0 ? own : std::max<int64_t>(1, pool.num_threads());
  const int64_t wanted = std::max<int64_t>(1, std::min<int64_t>(4 * workers, n / min_piece));
  if (wanted == 1) {
    body(0, n);
    return;
  }
  auto state = std::make_shared<Pieces>();
  state->n = n;
  state->per = ((n + wanted - 1) / wanted + 15) / 16 * 16;  // whole cache lines for every piece but the last
  state->count = (n + state->per - 1) / state->per;
  const int64_t helpers = std::min(workers, state->count) - 1;
  if (own > 0) {  // joined before returning: they may share the body by reference
    std::vector<std::thread> threads;
    for (int64_t t = 0; t < helpers; ++t) threads.emplace_back([&] { RunPieces(*state, body); });
    RunPieces(*state, body);
    for (auto& thread : threads) thread.join();
    return;
  }
  const Body* shared_body = &body;  // read only by a task that takes a piece, which the caller waits for
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([state, shared_body] { RunPieces(*state, *shared_body); });
  }
  RunPieces(*state, body);
  std::unique_lock<std::mutex> lock(state->mu);
  state->all_done.wait(lock, [&] { return state->done == state->count; });
}

// scalars: [lr, 1 - b1^t, 1 - b2^t, gradient multiplier, skip (nonzero: keep every old value)].
ffi::Error HostAdamWImpl(ffi::ThreadPool pool, ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> weights,
                         ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::F32> scalars,
                         ffi::Result<ffi::Buffer<ffi::F32>> new_weights, ffi::Result<ffi::Buffer<ffi::F32>> new_mu,
                         ffi::Result<ffi::Buffer<ffi::F32>> new_nu, ffi::Result<ffi::Buffer<ffi::BF16>> params,
                         float b1, float one_minus_b1, float b2, float one_minus_b2, float eps,
                         float decay) {
  const int64_t n = weights.element_count();
  if (grad.element_count() != n || mu.element_count() != n || nu.element_count() != n ||
      params->element_count() != n) {
    return ffi::Error::InvalidArgument("host_adamw: gradient, weights, moments and params differ in size");
  }
  if (scalars.element_count() != 5) {
    return ffi::Error::InvalidArgument("host_adamw: scalars must be [lr, bc1, bc2, multiplier, skip]");
  }
  float* w = new_weights->typed_data();
  float* m = new_mu->typed_data();
  float* v = new_nu->typed_data();
  // Outputs alias their inputs when the caller donates them; otherwise start from a copy.
  if (w != weights.typed_data()) std::memcpy(w, weights.typed_data(), n * sizeof(float));
  if (m != mu.typed_data()) std::memcpy(m, mu.typed_data(), n * sizeof(float));
  if (v != nu.typed_data()) std::memcpy(v, nu.typed_data(), n * sizeof(float));
  uint16_t* p = reinterpret_cast<uint16_t*>(params->typed_data());
  const float* c = scalars.typed_data();
  if (c[4] != 0.0f) {  // a step skipped for a non-finite gradient: the params are the old weights, rounded
    ParallelFor(pool, n, [&](int64_t b, int64_t e) { RoundRange(w, p, b, e); });
    return ffi::Error::Success();
  }
  const Step step{c[0], 1.0f / c[1], 1.0f / c[2], c[3], b1, one_minus_b1, b2, one_minus_b2, eps, decay};
  switch (grad.element_type()) {
    case ffi::DataType::F32: {
      const float* g = reinterpret_cast<const float*>(grad.untyped_data());
      ParallelFor(pool, n, [&](int64_t b, int64_t e) { UpdateRange(g, w, m, v, p, step, b, e); });
      break;
    }
    case ffi::DataType::BF16: {
      const uint16_t* g = reinterpret_cast<const uint16_t*>(grad.untyped_data());
      ParallelFor(pool, n, [&](int64_t b, int64_t e) { UpdateRange(g, w, m, v, p, step, b, e); });
      break;
    }
    default:
      return ffi::Error::InvalidArgument("host_adamw: the gradient must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- block-quantized moments
// m and v stored as codes of a sorted table times a per-block scale (jaxmem/optim/codes.py): blocks of
// `length` values along each row (the last dim), the block's value of largest magnitude (sign included) its
// scale, each normalized value stored as the index of the nearest table value: the number of midpoints at
// or below it, read from a bucket table over the float's bits and one comparison (codes.Code.buckets: the
// same index as the jnp code's search); for the sqrt-linear code round(16 sqrt(y)) - 1. 4-bit codes pair
// adjacent values in a byte, the even one in the low nibble. A block is read whole (its new m and v kept in
// a buffer) before its codes are written, so the codes and scales are updated in place.
struct Code {
  const float* table;
  const float* midpoints;   // 2^bits - 1 midpoints and a +inf after them
  const uint16_t* buckets;  // codes.Code.buckets: the midpoints below each bucket of float32 bit patterns
  int bits;
  bool sqrt_linear;
};

// y's bucket in codes.Code.buckets: its sign, exponent and top 7 mantissa bits. |y| <= 1 always (y is a value
// over its block's extreme); a NaN's codes are never read back (its block's scale is NaN), so its exponent is
// clamped rather than tested.
inline uint32_t BucketOf(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof(bits));
  const uint32_t exponent = std::min((bits >> 23) & 0xffu, 127u);
  return (bits >> 31) << 14 | exponent << 7 | ((bits >> 16) & 127u);
}

// round(16 sqrt(y)) - 1 clamped to [0, 15], without branches so that the block's loop vectorizes (a NaN gets 0).
inline int SqrtLinearCode(float y) {
  float k = std::nearbyint(std::sqrt(y > 0.0f ? y : 0.0f) * 16.0f);  // half to even, as jnp.round
  k = k < 1.0f ? 1.0f : k;
  k = k > 16.0f ? 16.0f : k;
  return static_cast<int>(k) - 1;
}

// The codes of buf[0, count) into idx. A code is the number of midpoints at or below the value: its bucket's
// count (no bucket of a shipped code holds two midpoints) plus one if it reaches the next midpoint. Found in
// passes over the block (bucket numbers, the table's counts, the comparison), each a loop that vectorizes.
void EncodeBlock(const Code& c, const float* __restrict buf, int64_t count, int32_t* __restrict idx) {
  if (c.sqrt_linear) {
    for (int64_t j = 0; j < count; ++j) idx[j] = SqrtLinearCode(buf[j]);
    return;
  }
  for (int64_t j = 0; j < count; ++j) idx[j] = static_cast<int32_t>(BucketOf(buf[j]));
  for (int64_t j = 0; j < count; ++j) idx[j] = c.buckets[idx[j]];
  for (int64_t j = 0; j < count; ++j) idx[j] += buf[j] >= c.midpoints[idx[j]] ? 1 : 0;
}

// The block's scale as codes.quantize takes it (the value of largest magnitude, sign included; NaN if any value
// is NaN, as numpy's max) and the codes of buf / scale (buf is overwritten with the normalized values; idx is
// scratch of `count` ints). The extremes are kept in 8 lanes of a GCC / Clang vector (compiled to the CPU's
// vector width; a lane's comparison with a NaN is false, so NaNs are found from the bits) and the division runs
// as its own loop, so each vectorizes.
void StoreBlock(const Code& c, bool is_signed, float* __restrict buf, int64_t count, uint8_t* row, int64_t begin,
                float* scale, int32_t* __restrict idx) {
  typedef float Lanes __attribute__((vector_size(32)));
  typedef uint32_t Bits __attribute__((vector_size(32)));
  constexpr int kLanes = 8;
  Lanes hi, lo;
  for (int k = 0; k < kLanes; ++k) hi[k] = lo[k] = buf[0];
  Bits nan_lanes = {};
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    Lanes x;
    Bits bits;
    std::memcpy(&x, buf + i, sizeof(x));
    std::memcpy(&bits, buf + i, sizeof(bits));
    hi = x > hi ? x : hi;
    lo = x < lo ? x : lo;
    nan_lanes |= (bits & 0x7fffffffu) > 0x7f800000u;
  }
  bool nan = false;
  float top = hi[0], bottom = lo[0];
  for (int k = 0; k < kLanes; ++k) {
    top = hi[k] > top ? hi[k] : top;
    bottom = lo[k] < bottom ? lo[k] : bottom;
    nan |= nan_lanes[k] != 0;
  }
  for (; i < count; ++i) {
    top = buf[i] > top ? buf[i] : top;
    bottom = buf[i] < bottom ? buf[i] : bottom;
    nan |= buf[i] != buf[i];
  }
  if (nan) top = bottom = std::numeric_limits<float>::quiet_NaN();
  const float s = is_signed ? (top >= -bottom ? top : bottom) : top;
  *scale = s;
  const float safe = s == 0.0f ? 1.0f : s;
  for (int64_t j = 0; j < count; ++j) buf[j] = buf[j] / safe;
  EncodeBlock(c, buf, count, idx);
  if (c.bits == 4) {  // begin is even: a block of several is a whole number of pairs
    for (int64_t j = 0; j + 1 < count; j += 2) row[(begin + j) / 2] = static_cast<uint8_t>(idx[j] | idx[j + 1] << 4);
    if (count % 2) row[(begin + count - 1) / 2] = static_cast<uint8_t>(idx[count - 1]);
  } else {
    for (int64_t j = 0; j < count; ++j) row[begin + j] = static_cast<uint8_t>(idx[j]);
  }
}

struct Lowbit {
  Code m, v;
  int64_t last, length, blocks, row_bytes;
};

// A block's codes as values (table value times the block's scale) into buf.
void LoadBlock(const Code& c, const uint8_t* row, int64_t begin, int64_t count, float scale, float* __restrict buf) {
  if (c.bits == 4) {  // begin is even: byte j of the block holds values 2j (low nibble) and 2j + 1
    const uint8_t* bytes = row + begin / 2;
    for (int64_t j = 0; j < count / 2; ++j) {
      buf[2 * j] = c.table[bytes[j] & 15] * scale;
      buf[2 * j + 1] = c.table[bytes[j] >> 4] * scale;
    }
    if (count % 2) buf[count - 1] = c.table[bytes[count / 2] & 15] * scale;
  } else {
    for (int64_t i = 0; i < count; ++i) buf[i] = c.table[row[begin + i]] * scale;
  }
}

// Per block: m and v dequantized into buffers, UpdateRange's step over them (the fp32 kernel's loop, which
// vectorizes), then the new m and v requantized.
template <typename G>
void LowbitRows(const G* __restrict grad, float* __restrict w, uint8_t* m_codes, float* m_scales, uint8_t* v_codes,
                float* v_scales, uint16_t* __restrict params, const Step& s, const Lowbit& q, int64_t row_begin,
                int64_t row_end) {
  std::vector<float> mbuf(q.length), vbuf(q.length);
  std::vector<int32_t> idx(q.length);
  for (int64_t r = row_begin; r < row_end; ++r) {
    uint8_t* mrow = m_codes + r * q.row_bytes;
    uint8_t* vrow = v_codes + r * q.row_bytes;
    for (int64_t b = 0; b < q.blocks; ++b) {
      const int64_t begin = b * q.length, count = std::min(q.length, q.last - begin);
      const int64_t at = r * q.last + begin;
      LoadBlock(q.m, mrow, begin, count, m_scales[r * q.blocks + b], mbuf.data());
      LoadBlock(q.v, vrow, begin, count, v_scales[r * q.blocks + b], vbuf.data());
      UpdateRange(grad + at, w + at, mbuf.data(), vbuf.data(), params + at, s, 0, count);
      StoreBlock(q.m, true, mbuf.data(), count, mrow, begin, &m_scales[r * q.blocks + b], idx.data());
      StoreBlock(q.v, false, vbuf.data(), count, vrow, begin, &v_scales[r * q.blocks + b], idx.data());
    }
  }
}

template <typename T>
T* InPlace(ffi::Result<ffi::AnyBuffer>& out, const ffi::AnyBuffer& in) {
  T* dst = reinterpret_cast<T*>(out->untyped_data());
  if (dst != in.untyped_data()) std::memcpy(dst, in.untyped_data(), in.size_bytes());
  return dst;
}

// As HostAdamWImpl, with m and v block-quantized: codes (uint8) and scales (f32 [rows, blocks]) in and out,
// the two codes' tables and midpoints as inputs.
ffi::Error HostAdamWLowbitImpl(ffi::ThreadPool pool, ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> weights,
                               ffi::AnyBuffer m_codes, ffi::AnyBuffer m_scales, ffi::AnyBuffer v_codes,
                               ffi::AnyBuffer v_scales, ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::F32> m_table,
                               ffi::Buffer<ffi::F32> m_midpoints, ffi::Buffer<ffi::U16> m_buckets,
                               ffi::Buffer<ffi::F32> v_table, ffi::Buffer<ffi::F32> v_midpoints,
                               ffi::Buffer<ffi::U16> v_buckets, ffi::Result<ffi::Buffer<ffi::F32>> new_weights,
                               ffi::Result<ffi::AnyBuffer> new_m_codes, ffi::Result<ffi::AnyBuffer> new_m_scales,
                               ffi::Result<ffi::AnyBuffer> new_v_codes, ffi::Result<ffi::AnyBuffer> new_v_scales,
                               ffi::Result<ffi::Buffer<ffi::BF16>> params, float b1, float one_minus_b1, float b2,
                               float one_minus_b2, float eps, float decay, int64_t bits, int64_t v_sqrt_linear,
                               int64_t length) {
  const int64_t n = weights.element_count();
  const auto dims = weights.dimensions();
  const int64_t last = dims.size() == 0 ? 1 : dims.back();
  const int64_t rows = last ? n / last : 0;
  const int64_t blocks = (last + length - 1) / length;
  const int64_t row_bytes = bits == 4 ? (last + 1) / 2 : last;
  if (grad.element_count() != n || params->element_count() != n || scalars.element_count() != 5 ||
      m_codes.size_bytes() != static_cast<size_t>(rows * row_bytes) || v_codes.size_bytes() != m_codes.size_bytes() ||
      m_scales.element_count() != rows * blocks || v_scales.element_count() != rows * blocks ||
      (bits != 4 && bits != 8) || m_table.element_count() != (1 << bits) ||
      m_midpoints.element_count() != (1 << bits) || v_midpoints.element_count() != (1 << bits) ||
      v_table.element_count() != (1 << bits) || m_buckets.element_count() != (1 << 15) ||
      v_buckets.element_count() != (1 << 15)) {
    return ffi::Error::InvalidArgument("host_adamw_lowbit: the codes, scales, tables or block do not match");
  }
  float* w = new_weights->typed_data();
  if (w != weights.typed_data()) std::memcpy(w, weights.typed_data(), n * sizeof(float));
  uint8_t* mc = InPlace<uint8_t>(new_m_codes, m_codes);
  uint8_t* vc = InPlace<uint8_t>(new_v_codes, v_codes);
  float* ms = InPlace<float>(new_m_scales, m_scales);
  float* vs = InPlace<float>(new_v_scales, v_scales);
  uint16_t* p = reinterpret_cast<uint16_t*>(params->typed_data());
  const float* c = scalars.typed_data();
  // pieces of whole rows (a block never straddles two threads), each at least kMinPiece values
  const int64_t min_rows = std::max<int64_t>(1, kMinPiece / std::max<int64_t>(last, 1));
  auto over_rows = [&](const auto& body) { ParallelFor(pool, rows, body, min_rows); };
  if (c[4] != 0.0f) {
    ParallelFor(pool, n, [&](int64_t b, int64_t e) { RoundRange(w, p, b, e); });
    return ffi::Error::Success();
  }
  const Step step{c[0], 1.0f / c[1], 1.0f / c[2], c[3], b1, one_minus_b1, b2, one_minus_b2, eps, decay};
  const Lowbit q{{m_table.typed_data(), m_midpoints.typed_data(), m_buckets.typed_data(), static_cast<int>(bits),
                  false},
                 {v_table.typed_data(), v_midpoints.typed_data(), v_buckets.typed_data(), static_cast<int>(bits),
                  v_sqrt_linear != 0},
                 last, length, blocks, row_bytes};
  switch (grad.element_type()) {
    case ffi::DataType::F32: {
      const float* g = reinterpret_cast<const float*>(grad.untyped_data());
      over_rows([&](int64_t b, int64_t e) { LowbitRows(g, w, mc, ms, vc, vs, p, step, q, b, e); });
      break;
    }
    case ffi::DataType::BF16: {
      const uint16_t* g = reinterpret_cast<const uint16_t*>(grad.untyped_data());
      over_rows([&](int64_t b, int64_t e) { LowbitRows(g, w, mc, ms, vc, vs, p, step, q, b, e); });
      break;
    }
    default:
      return ffi::Error::InvalidArgument("host_adamw_lowbit: the gradient must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

// AdamW's hyperparameters: the attributes both handlers take after their buffers.
template <typename Binding>
auto WithAdamAttrs(Binding binding) {
  return std::move(binding).template Attr<float>("b1")
      .template Attr<float>("one_minus_b1")
      .template Attr<float>("b2")
      .template Attr<float>("one_minus_b2")
      .template Attr<float>("eps")
      .template Attr<float>("decay");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemHostAdamW, HostAdamWImpl,
                              WithAdamAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemHostAdamWLowbit, HostAdamWLowbitImpl,
                              WithAdamAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>())
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("v_sqrt_linear")
                                  .Attr<int64_t>("length"));
