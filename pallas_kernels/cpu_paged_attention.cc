// Ragged paged attention for the CPU, an XLA FFI handler: the kernel behind impl="cpu".
// cpu_paged_attention.py builds this file, registers the handler and documents the contract;
// reference.py is the oracle it is tested against.
//
// One work item is one query row and one KV head: its G = H / KVH query heads read the row's
// visible keys, page by page through the sequence's block table, straight out of the stacked
// pool [L, KVH, N, bs, D] (no gather, no copy), then take an exact softmax over the scores and
// read the values the same way. The items are shared out over XLA's intra-op thread pool.
// q and the output are float32 (the caller casts); the pages are float32, bfloat16 or float16.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct BF16 {
  uint16_t bits;
};

inline float load(float x) { return x; }
inline float load(_Float16 x) { return static_cast<float>(x); }
inline float load(BF16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// exp(x) for x <= 0 in a form the compiler vectorises (libm's expf is a scalar call, and the
// softmax makes G of them per key): 2^n * e^g with n = round(x / ln 2), g = x - n ln 2 in
// [-ln2/2, ln2/2] (Cody-Waite split), e^g by its Taylor series to g^7 (relative error < 1e-7).
// x below -87 gives about 1e-38 instead of 0 or a denormal: nothing next to the row's maximum,
// whose term is 1.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float g = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float e = 1.0f / 5040.0f;
  e = e * g + 1.0f / 720.0f;
  e = e * g + 1.0f / 120.0f;
  e = e * g + 1.0f / 24.0f;
  e = e * g + 1.0f / 6.0f;
  e = e * g + 0.5f;
  e = e * g + 1.0f;
  e = e * g + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return e * scale;
}

// Eight float lanes (GCC / clang vector extensions: whatever SIMD the target has).
typedef float V8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, I8{__VA_ARGS__})
#endif

inline V8 LoadV8(const float* x) {
  V8 v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

// Lane k of the result is the sum of v[k]'s lanes: eight dot products finished with 14
// shuffles and 7 adds, where eight horizontal sums would take about 50 dependent operations.
inline V8 TransposeSum8(const V8* v) {
  V8 t[4], u[2];
  for (int i = 0; i < 4; ++i) {
    t[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           SHUFFLE(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {
    u[i] = SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           SHUFFLE(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return SHUFFLE(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         SHUFFLE(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Scores of `count` consecutive keys (rows of D = kD floats) against one query head.
template <int kD>
inline void ScoresF32(const float* q, const float* rows, int64_t count, float* out) {
  static_assert(kD % 8 == 0, "whole vectors");
  V8 qv[kD / 8];
  for (int c = 0; c < kD / 8; ++c) qv[c] = LoadV8(q + 8 * c);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    V8 acc[8];
    for (int k = 0; k < 8; ++k) {
      const float* r = rows + (i + k) * kD;
      V8 a = qv[0] * LoadV8(r);
      for (int c = 1; c < kD / 8; ++c) a += qv[c] * LoadV8(r + 8 * c);
      acc[k] = a;
    }
    const V8 sum = TransposeSum8(acc);
    std::memcpy(out + i, &sum, sizeof sum);
  }
  for (; i < count; ++i) {
    float dot = 0.0f;
    for (int d = 0; d < kD; ++d) dot += q[d] * rows[i * kD + d];
    out[i] = dot;
  }
}

struct Problem {
  const void* q;       // [T, H, D] float32
  const void* k;       // [L, KVH, N, bs, D]
  const void* v;       // [L, KVH, N, bs, D]
  void* out;           // [T, H, D] float32
  const int32_t* tables;  // [S, P]
  const int32_t* seq;     // [T] each row's sequence
  const int32_t* pos;     // [T] each row's position, -1 for padding rows
  int64_t T, H, KVH, N, bs, D, S, P, G, layer;
  float scale;
  int64_t window;  // 0: none
  float cap;       // 0: none
};

// The page holding key j of a sequence (clamped into the pool: a wild entry must not fault).
inline int64_t Page(const Problem& p, const int32_t* table, int64_t j) {
  return std::clamp<int64_t>(table[j / p.bs], 0, p.N - 1);
}

// Asks for a page's cache lines ahead of use: pages are scattered over the pool, so the
// hardware prefetcher, which follows a stream, cannot guess the next one.
template <typename T>
inline void Prefetch(const T* first, int64_t count) {
  const char* c = reinterpret_cast<const char*>(first);
  for (int64_t i = 0; i < count * static_cast<int64_t>(sizeof(T)); i += 64) {
    __builtin_prefetch(c + i);
  }
}

// Row t, KV head kh: out[t, kh*G:(kh+1)*G] = softmax(scale * q.K^T) V over the row's keys.
// kD is the head dim when it is a compile-time constant (the common 64, 128, 256: the loops over
// D unroll and a head's accumulator lives in registers), else 0 and p.D is read at run time.
template <typename T, int kD>
void AttendRow(const Problem& p, int64_t t, int64_t kh, std::vector<float>& scratch) {
  const int64_t D = kD ? kD : p.D, G = p.G, bs = p.bs;
  float* out = static_cast<float*>(p.out) + (t * p.H + kh * G) * D;
  int64_t hi = std::min<int64_t>(p.pos[t], p.P * bs - 1);
  int64_t lo = p.window > 0 ? std::max<int64_t>(0, hi - p.window + 1) : 0;
  int64_t s = p.seq[t];
  if (hi < 0 || s < 0 || s >= p.S) {  // padding row (or no key): zeros
    std::fill(out, out + G * D, 0.0f);
    return;
  }
  const int64_t n = hi - lo + 1;
  scratch.resize(G * D + G * n);
  float* qf = scratch.data();  // [G, D] scaled queries
  float* sc = qf + G * D;      // [G, n] scores, then probabilities
  const float* q = static_cast<const float*>(p.q) + (t * p.H + kh * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = q[i] * p.scale;
  const int32_t* table = p.tables + s * p.P;
  const int64_t head = (p.layer * p.KVH + kh) * p.N;  // first page of (layer, kh)
  const T* kbase = static_cast<const T*>(p.k);
  const T* vbase = static_cast<const T*>(p.v);
  // The first values are asked for now, to arrive while the keys are read.
  Prefetch(vbase + (head + Page(p, table, lo)) * bs * D + (lo % bs) * D, (bs - lo % bs) * D);

  // Scores: keys lo..hi one page at a time (a page's rows are contiguous [bs, D]); within a
  // page, one query head at a time over the page's keys, which stay in the L1 cache.
  for (int64_t j = lo; j <= hi;) {
    const int64_t end = std::min(hi + 1, j - j % bs + bs);
    const T* rows = kbase + ((head + Page(p, table, j)) * bs + j % bs) * D;
    if (end <= hi) Prefetch(kbase + (head + Page(p, table, end)) * bs * D, bs * D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float* sg = sc + g * n + (j - lo);
      if constexpr (std::is_same_v<T, float> && kD > 0) {
        ScoresF32<kD>(qg, rows, end - j, sg);
      } else {
        const T* row = rows;
        for (int64_t i = 0; i < end - j; ++i, row += D) {
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * load(row[d]);
          sg[i] = dot;
        }
      }
    }
    j = end;
  }
  float denom[64];  // G <= 64 (checked by the caller)
  for (int64_t g = 0; g < G; ++g) {
    float* sg = sc + g * n;
    if (p.cap > 0.0f) {  // cap tanh(s / cap); tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|)
      const float cap = p.cap, inv = 1.0f / p.cap;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float y = sg[i] * inv;
        const float e = ExpNonPositive(-2.0f * std::fabs(y));
        sg[i] = std::copysign(cap * (1.0f - e) / (1.0f + e), y);
      }
    }
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
    float l = 0.0f;
#pragma omp simd reduction(+ : l)
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = ExpNonPositive(sg[i] - m);
      l += sg[i];
    }
    denom[g] = l;
  }
  // Output: the values weighted the same way; qf's rows are reused as the accumulators.
  float* acc = qf;
  std::fill(acc, acc + G * D, 0.0f);
  for (int64_t j = lo; j <= hi;) {
    const int64_t end = std::min(hi + 1, j - j % bs + bs);
    const T* rows = vbase + ((head + Page(p, table, j)) * bs + j % bs) * D;
    if (end <= hi) Prefetch(vbase + (head + Page(p, table, end)) * bs * D, bs * D);
    for (int64_t g = 0; g < G; ++g) {
      float a[kD ? kD : 1];  // the head's accumulator, in registers when D is static
      float* ag = kD ? a : acc + g * D;
      if (kD) std::copy(acc + g * D, acc + (g + 1) * D, a);
      const float* wg = sc + g * n + (j - lo);
      const T* row = rows;
      for (int64_t i = 0; i < end - j; ++i, row += D) {
        const float w = wg[i];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += w * load(row[d]);
      }
      if (kD) std::copy(a, a + D, acc + g * D);
    }
    j = end;
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / denom[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
  }
}

// Items [0, T * KVH) handed out in grains through one counter: the calling thread and the
// helpers it scheduled take grains until none is left, then the caller waits for the grains
// already taken. A helper that starts late finds no work and returns, so a busy pool never
// deadlocks the call; the shared state outlives such a helper.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename T>
void Run(const Problem& p, ffi::ThreadPool& pool) {
  const int64_t items = p.T * p.KVH;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t grain = std::max<int64_t>(1, items / (threads * 8));
  auto shared = std::make_shared<Shared>();
  auto work = [p, shared, items, grain]() {
    thread_local std::vector<float> scratch;
    for (;;) {
      const int64_t first = shared->next.fetch_add(grain);
      if (first >= items) return;
      const int64_t last = std::min(items, first + grain);
      for (int64_t i = first; i < last; ++i) {
        switch (p.D) {
          case 64:
            AttendRow<T, 64>(p, i / p.KVH, i % p.KVH, scratch);
            break;
          case 128:
            AttendRow<T, 128>(p, i / p.KVH, i % p.KVH, scratch);
            break;
          case 256:
            AttendRow<T, 256>(p, i / p.KVH, i % p.KVH, scratch);
            break;
          default:
            AttendRow<T, 0>(p, i / p.KVH, i % p.KVH, scratch);
        }
      }
      shared->done.fetch_add(last - first, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min(threads, (items + grain - 1) / grain) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work]() { work(); });
  work();
  while (shared->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                              ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> pos,
                              ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out,
                              float scale, int64_t sliding_window, float soft_cap) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2) {
    return ffi::Error::InvalidArgument("expected q [T, H, D], pages [L, KVH, N, bs, D], "
                                       "tables [S, P]");
  }
  if (q.element_type() != ffi::DataType::F32 || out->element_type() != ffi::DataType::F32 ||
      v.element_type() != k.element_type()) {
    return ffi::Error::InvalidArgument("q and the output must be float32, the K and V pages "
                                       "of one dtype");
  }
  Problem p;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.tables = tables.typed_data();
  p.seq = seq.typed_data();
  p.pos = pos.typed_data();
  p.T = qd[0];
  p.H = qd[1];
  p.D = qd[2];
  p.KVH = kd[1];
  p.N = kd[2];
  p.bs = kd[3];
  p.S = td[0];
  p.P = td[1];
  if (kd[4] != p.D || p.KVH < 1 || p.H % p.KVH || p.H / p.KVH > 64) {
    return ffi::Error::InvalidArgument("bad head dims: need D == pages' D, H % KVH == 0, "
                                       "H / KVH <= 64");
  }
  p.G = p.H / p.KVH;
  p.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, kd[0] - 1);
  p.scale = scale;
  p.window = sliding_window;
  p.cap = soft_cap;
  switch (k.element_type()) {  // the pages' dtype
    case ffi::DataType::F32:
      Run<float>(p, pool);
      break;
    case ffi::DataType::BF16:
      Run<BF16>(p, pool);
      break;
    case ffi::DataType::F16:
      Run<_Float16>(p, pool);
      break;
    default:
      return ffi::Error::InvalidArgument("dtype must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedCpuPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()     // q
                                  .Arg<ffi::AnyBuffer>()     // k_pages
                                  .Arg<ffi::AnyBuffer>()     // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::AnyBuffer>()     // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
