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
#include <memory>
#include <mutex>
#include <thread>
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
int64_t OwnThreads(int64_t pool_threads) {
  const char* asked = std::getenv("JAXMEM_HOST_ADAMW_THREADS");
  if (asked != nullptr && std::atoll(asked) > 0) return std::atoll(asked);
  if (pool_threads > 0) return 0;
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const Body& body) {
  constexpr int64_t kMinPiece = 1 << 16;
  const int64_t own = OwnThreads(pool.num_threads());
  const int64_t workers = own > 0 ? own : std::max<int64_t>(1, pool.num_threads());
  const int64_t wanted = std::max<int64_t>(1, std::min<int64_t>(4 * workers, n / kMinPiece));
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmemHostAdamW, HostAdamWImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<float>("b1")
                                  .Attr<float>("one_minus_b1")
                                  .Attr<float>("b2")
                                  .Attr<float>("one_minus_b2")
                                  .Attr<float>("eps")
                                  .Attr<float>("decay"));
