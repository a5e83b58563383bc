// Ragged paged attention for the CPU, an XLA FFI handler: the kernel behind impl="cpu".
// cpu_paged_attention.py builds this file, registers the handler and documents the contract;
// reference.py is the oracle it is tested against.
//
// One work item is one query row and one KV head: its G = H / KVH query heads read the row's
// visible keys through the sequence's block table, straight out of the stacked pool
// [L, KVH, N, bs, D] (no gather, no copy), each key row loaded once for all G heads, then take an
// exact softmax over the scores and read the values the same way. The items are shared out over
// XLA's intra-op thread pool.
// q and the output are float32 (the caller casts); the pages are float32, bfloat16 or float16.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The library is compiled in parts, in parallel, then linked (cpu_paged_attention.py):
// JAX_PAGED_PART 0 holds the handlers and the float32 kernels, 1 the bfloat16 and 2 the float16
// ones.
#if !defined(JAX_PAGED_PART)
#error "compile with -DJAX_PAGED_PART=0, 1 and 2 and link the three (cpu_paged_attention.py)"
#endif
#define JAX_PAGED_PART_0 (JAX_PAGED_PART == 0)
#define JAX_PAGED_PART_1 (JAX_PAGED_PART == 1)
#define JAX_PAGED_PART_2 (JAX_PAGED_PART == 2)

namespace jax_paged_cpu {

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

// The kernel for each dtype of the pages, each defined in its own part.
void RunF32(const Problem& p, ffi::ThreadPool& pool);
void RunBF16(const Problem& p, ffi::ThreadPool& pool);
void RunF16(const Problem& p, ffi::ThreadPool& pool);

}  // namespace jax_paged_cpu

namespace {

using jax_paged_cpu::Problem;

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

// Sixteen float lanes (GCC / clang vector extensions: one AVX-512 register, two AVX ones...).
typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef _Float16 H16x16 __attribute__((vector_size(32)));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, I16{__VA_ARGS__})
#endif

// Sixteen consecutive elements widened to float32.
inline V16 Load16(const float* x) {
  V16 v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
inline V16 Load16(const BF16* x) {  // bfloat16 is float32's upper half
  U16x16 h;
  std::memcpy(&h, x, sizeof h);
  const U32x16 w = __builtin_convertvector(h, U32x16) << 16;
  V16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline V16 Load16(const _Float16* x) {
  H16x16 h;
  std::memcpy(&h, x, sizeof h);
  return __builtin_convertvector(h, V16);
}

// Lane i of the result is the sum of v[i]'s lanes: sixteen dot products finished with 30
// shuffles and 15 adds (pairs, then quads, octets and halves folded), where sixteen horizontal
// sums would take over a hundred dependent operations.
inline V16 TransposeSum16(const V16* v) {
  V16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                   14, 30) +
           SHUFFLE(v[2 * i], v[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                   15, 31);
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                   29) +
           SHUFFLE(a[2 * i], a[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                   30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                   27) +
           SHUFFLE(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                   30, 31);
  }
  return SHUFFLE(c[0], c[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         SHUFFLE(c[0], c[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

// Asks for a page's cache lines ahead of use: pages are scattered over the pool, so the
// hardware prefetcher, which follows a stream, cannot guess the next one. Into every cache level
// (locality 3): the non-temporal hint (locality 0) made SmolLM2's decode attention 2-3x slower on
// a 2-core Sapphire Rapids (30 layers, 32 rows of 75 keys: 6.2-6.5 ms against 17-18 ms, float32
// pages; 64 rows of 100 keys: 19-21 ms against 44-45 ms; bfloat16 pages 1.6-2x); no
// prefetch at all fell between the two at most shapes.
template <typename T>
inline void Prefetch(const T* first, int64_t count) {
  const char* c = reinterpret_cast<const char*>(first);
  for (int64_t i = 0; i < count * static_cast<int64_t>(sizeof(T)); i += 64) {
    __builtin_prefetch(c + i, 0, 3);
  }
}

// A thread's scratch for a row's key offsets.
inline int64_t* OffsetScratch(int64_t n) {
  thread_local std::vector<int64_t> offs;
  if (static_cast<int64_t>(offs.size()) < n) offs.resize(n);
  return offs.data();
}

// Row t, KV head kh: out[t, kh*G:(kh+1)*G] = softmax(scale * q.K^T) V over the row's keys.
// kD is the head dim and kG the number of query heads per KV head when they are compile-time
// constants (kD a multiple of 16: the loops over D unroll into whole vectors and the heads'
// accumulators live in registers), else 0 and p.D / p.G are read at run time.
//
// Each key and value row is loaded once for all G heads. Scores go to sc[key * G + g] (key
// major), KB = 16 / G keys x G heads at a time, sixteen dot products folded by one
// TransposeSum16 and stored as one vector; the softmax then runs over that flat array in
// chunks of 16 G floats, whose lane i always belongs to head i % G.
template <typename T, int kD, int kG>
void AttendRow(const Problem& p, int64_t t, int64_t kh, std::vector<float>& scratch) {
  const int64_t D = kD ? kD : p.D, G = kG ? kG : p.G, bs = p.bs;
  float* out = static_cast<float*>(p.out) + (t * p.H + kh * G) * D;
  const int64_t hi = std::min<int64_t>(p.pos[t], p.P * bs - 1);
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, hi - p.window + 1) : 0;
  const int64_t s = p.seq[t];
  if (hi < 0 || s < 0 || s >= p.S) {  // padding row (or no key): zeros
    std::fill(out, out + G * D, 0.0f);
    return;
  }
  const int64_t n = hi - lo + 1, chunk = 16 * G;
  const int64_t flat = n * G, padded = (flat + chunk - 1) / chunk * chunk;
  scratch.resize(G * D + padded + 16 + 2 * chunk);
  float* qf = scratch.data();  // [G, D] scaled queries, then the output accumulators
  float* sc = qf + G * D;      // [n, G] scores, then probabilities; padded to whole chunks
  float* lanes = sc + padded + 16;  // [2, chunk]: per-lane maxima and sums
  const float* q = static_cast<const float*>(p.q) + (t * p.H + kh * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = q[i] * p.scale;
  const int32_t* table = p.tables + s * p.P;
  const int64_t head = (p.layer * p.KVH + kh) * p.N;  // first page of (layer, kh)
  const T* kbase = static_cast<const T*>(p.k);
  const T* vbase = static_cast<const T*>(p.v);
  // Each visible key's row offset in the pages (the same for K and V), page by page: no
  // division per key. Table entries are clamped into the pool: a wild one must not fault.
  int64_t* offs = OffsetScratch(n);
  for (int64_t j = lo, pg = lo / bs, in = lo % bs; j <= hi; ++pg, in = 0) {
    const int64_t first = (head + std::clamp<int64_t>(table[pg], 0, p.N - 1)) * bs;
    for (; in < bs && j <= hi; ++in, ++j) offs[j - lo] = (first + in) * D;
  }
  // The first page of keys and values now; later pages are asked for a page ahead of the keys.
  Prefetch(kbase + offs[0], std::min(n, bs - lo % bs) * D);
  Prefetch(vbase + offs[0], std::min(n, bs - lo % bs) * D);
  int64_t ahead = bs - lo % bs;  // index (from lo) of the first key not yet asked for
  auto prefetch_to = [&](int64_t k) {  // pages up to key index k (from lo)
    for (; ahead < n && ahead <= k; ahead += bs) {
      const int64_t len = std::min(bs, n - ahead) * D;
      Prefetch(kbase + offs[ahead], len);
      Prefetch(vbase + offs[ahead], len);
    }
  };
  if constexpr (kD > 0) {
    static_assert(kD % 16 == 0, "whole vectors");
    constexpr int C = kD / 16;
    const int64_t GC = std::min<int64_t>(G, 16), KB = 16 / GC;
    for (int64_t g0 = 0; g0 < G; g0 += GC) {
      const int64_t gc = std::min(GC, G - g0);
      for (int64_t k0 = lo; k0 <= hi; k0 += KB) {
        prefetch_to(k0 - lo + bs);
        const int64_t kb = std::min(KB, hi + 1 - k0);
        V16 acc[16];
        for (int64_t k = 0; k < KB; ++k) {
          if (k < kb) {
            const T* r = kbase + offs[k0 - lo + k];
            V16 rv[C];
            for (int c = 0; c < C; ++c) rv[c] = Load16(r + 16 * c);
            for (int64_t g = 0; g < gc; ++g) {
              const float* qg = qf + (g0 + g) * kD;
              V16 a = Load16(qg) * rv[0];
              for (int c = 1; c < C; ++c) a += Load16(qg + 16 * c) * rv[c];
              acc[k * GC + g] = a;
            }
            for (int64_t g = gc; g < GC; ++g) acc[k * GC + g] = V16{};
          } else {
            for (int64_t g = 0; g < GC; ++g) acc[k * GC + g] = V16{};
          }
        }
        for (int64_t i = KB * GC; i < 16; ++i) acc[i] = V16{};
        const V16 x = TransposeSum16(acc);
        float* dst = sc + (k0 - lo) * G;
        if (GC == G) {  // the block's kb * G scores are contiguous (the rest is overwritten)
          std::memcpy(dst, &x, sizeof x);
        } else {
          for (int64_t k = 0; k < kb; ++k)
            for (int64_t g = 0; g < gc; ++g) dst[k * G + g0 + g] = x[k * GC + g];
        }
      }
    }
  } else {
    for (int64_t j = lo; j <= hi; ++j) {
      prefetch_to(j - lo + bs);
      const T* r = kbase + offs[j - lo];
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * load(r[d]);
        sc[(j - lo) * G + g] = dot;
      }
    }
  }

  // Softmax per head over the flat [n, G] scores: lane i of every chunk is head i % G.
  std::fill(sc + flat, sc + padded, -INFINITY);
  if (p.cap > 0.0f) {  // cap tanh(s / cap); tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|)
    const float cap = p.cap, inv = 1.0f / p.cap;
#pragma omp simd
    for (int64_t i = 0; i < flat; ++i) {
      const float y = sc[i] * inv;
      const float e = ExpNonPositive(-2.0f * std::fabs(y));
      sc[i] = std::copysign(cap * (1.0f - e) / (1.0f + e), y);
    }
  }
  float* mx = lanes;
  float* sum = lanes + chunk;
  std::fill(mx, mx + chunk, -INFINITY);
  for (int64_t c = 0; c < padded; c += chunk) {
#pragma omp simd
    for (int64_t i = 0; i < chunk; ++i) mx[i] = std::max(mx[i], sc[c + i]);
  }
  float m[64], denom[64];  // G <= 64 (checked by the caller)
  std::fill(m, m + G, -INFINITY);
  for (int64_t i = 0; i < chunk; ++i) m[i % G] = std::max(m[i % G], mx[i]);
  for (int64_t i = 0; i < chunk; ++i) mx[i] = m[i % G];  // now each lane's head maximum
  std::fill(sum, sum + chunk, 0.0f);
  for (int64_t c = 0; c < padded; c += chunk) {
#pragma omp simd
    for (int64_t i = 0; i < chunk; ++i) {
      const float e = ExpNonPositive(sc[c + i] - mx[i]);
      sc[c + i] = e;
      sum[i] += e;
    }
  }
  std::fill(denom, denom + G, 0.0f);
  for (int64_t i = 0; i < chunk; ++i) denom[i % G] += sum[i];

  // Output: the values weighted the same way, each value row loaded once for all G heads.
  float* acc = qf;  // [G, D]
  if constexpr (kD > 0 && kG > 0) {
    constexpr int C = kD / 16;
    V16 a[kG][C] = {};
    for (int64_t j = 0; j < n; ++j) {
      const T* r = vbase + offs[j];
      const float* w = sc + j * kG;
      V16 rv[C];
      for (int c = 0; c < C; ++c) rv[c] = Load16(r + 16 * c);
      for (int g = 0; g < kG; ++g)
        for (int c = 0; c < C; ++c) a[g][c] += w[g] * rv[c];
    }
    for (int g = 0; g < kG; ++g) {
      const float inv = 1.0f / denom[g];
      for (int c = 0; c < C; ++c) {
        const V16 o = a[g][c] * inv;
        std::memcpy(out + g * kD + 16 * c, &o, sizeof o);
      }
    }
  } else {
    std::fill(acc, acc + G * D, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const T* r = vbase + offs[j];
      const float* w = sc + j * G;
      for (int64_t g = 0; g < G; ++g) {
        float* ag = acc + g * D;
        const float wg = w[g];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += wg * load(r[d]);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.0f / denom[g];
      for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
    }
  }
}

template <typename T, int kD>
void AttendRowG(const Problem& p, int64_t t, int64_t kh, std::vector<float>& scratch) {
  switch (p.G) {
    case 1: return AttendRow<T, kD, 1>(p, t, kh, scratch);
    case 2: return AttendRow<T, kD, 2>(p, t, kh, scratch);
    case 3: return AttendRow<T, kD, 3>(p, t, kh, scratch);
    case 4: return AttendRow<T, kD, 4>(p, t, kh, scratch);
    case 8: return AttendRow<T, kD, 8>(p, t, kh, scratch);
    default: return AttendRow<T, kD, 0>(p, t, kh, scratch);
  }
}

// Items [0, T * KVH), KV head major (item i is row i % T, KV head i / T): the pool is laid out
// KV head major too, so consecutive items of rows whose pages were allocated one after the
// other (a batch's prompts) read one stream of memory (about 6% faster than row-major items at
// SmolLM2's decode shapes with the engine's page order, 8% at a prefill shape). They are handed
// out in grains through one counter: the calling thread and the helpers it scheduled take
// grains until none is left, then the caller waits for the grains already taken. A helper that
// starts late finds no work and returns, so a busy pool never deadlocks the call; the shared
// state outlives such a helper.
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
            AttendRowG<T, 64>(p, i % p.T, i / p.T, scratch);
            break;
          case 128:
            AttendRowG<T, 128>(p, i % p.T, i / p.T, scratch);
            break;
          case 256:
            AttendRowG<T, 256>(p, i % p.T, i / p.T, scratch);
            break;
          default:
            AttendRow<T, 0, 0>(p, i % p.T, i / p.T, scratch);
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

}  // namespace

#if JAX_PAGED_PART_0
void jax_paged_cpu::RunF32(const Problem& p, ffi::ThreadPool& pool) { Run<float>(p, pool); }
#endif
#if JAX_PAGED_PART_1
void jax_paged_cpu::RunBF16(const Problem& p, ffi::ThreadPool& pool) { Run<BF16>(p, pool); }
#endif
#if JAX_PAGED_PART_2
void jax_paged_cpu::RunF16(const Problem& p, ffi::ThreadPool& pool) { Run<_Float16>(p, pool); }
#endif

#if JAX_PAGED_PART_0
namespace {

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
      jax_paged_cpu::RunF32(p, pool);
      break;
    case ffi::DataType::BF16:
      jax_paged_cpu::RunBF16(p, pool);
      break;
    case ffi::DataType::F16:
      jax_paged_cpu::RunF16(p, pool);
      break;
    default:
      return ffi::Error::InvalidArgument("dtype must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

// The pool's own updates, in place (the result aliases the pages). XLA's CPU backend has no
// bfloat16 scatter: it widens the whole pool to float32 around one, three pool-sized passes per
// layer and step, so a bfloat16 cache is written here. Both only move bytes (any dtype).

// pages[layer, :, blk[t], off[t], :] = rows[t] for every token t whose slot is in the pool.
ffi::Error WriteRowsImpl(ffi::AnyBuffer pages, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> blk, ffi::Buffer<ffi::S32> off,
                         ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pages.dimensions();
  auto rd = rows.dimensions();
  if (pd.size() != 5 || rd.size() != 3 || rd[1] != pd[1] || rd[2] != pd[4] ||
      rows.element_type() != pages.element_type() || blk.element_count() != rd[0] ||
      off.element_count() != rd[0]) {
    return ffi::Error::InvalidArgument("expected pages [L, KVH, N, bs, D], rows [T, KVH, D] of "
                                       "the pages' dtype, blk and off [T]");
  }
  const int64_t L = pd[0], KVH = pd[1], N = pd[2], bs = pd[3], D = pd[4], T = rd[0];
  const int64_t esize = ffi::ByteWidth(pages.element_type());
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pages.untyped_data()) std::memcpy(dst, pages.untyped_data(), pages.size_bytes());
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::Success();
  const char* src = static_cast<const char*>(rows.untyped_data());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = blk.typed_data()[t], o = off.typed_data()[t];
    if (b < 0 || b >= N || o < 0 || o >= bs) continue;  // dropped, as mode="drop"
    for (int64_t h = 0; h < KVH; ++h) {
      std::memcpy(dst + ((((l * KVH + h) * N + b) * bs + o) * D) * esize,
                  src + ((t * KVH + h) * D) * esize, D * esize);
    }
  }
  return ffi::Error::Success();
}

// pages[:, :, dst[i]] = pages[:, :, src[i]] for every pair with src != dst, the sources read
// before any is written (chains copy the old contents).
ffi::Error CopyPagesImpl(ffi::AnyBuffer pages, ffi::Buffer<ffi::S32> src,
                         ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pages.dimensions();
  if (pd.size() != 5 || src.element_count() != dst.element_count()) {
    return ffi::Error::InvalidArgument("expected pages [L, KVH, N, bs, D], src and dst [M]");
  }
  const int64_t LK = pd[0] * pd[1], N = pd[2];
  const int64_t page = pd[3] * pd[4] * ffi::ByteWidth(pages.element_type());
  char* base = static_cast<char*>(out->untyped_data());
  if (base != pages.untyped_data()) std::memcpy(base, pages.untyped_data(), pages.size_bytes());
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (size_t i = 0; i < src.element_count(); ++i) {
    const int64_t s = src.typed_data()[i], d = dst.typed_data()[i];
    if (s != d && s >= 0 && s < N && d >= 0 && d < N) pairs.emplace_back(s, d);
  }
  if (pairs.empty()) return ffi::Error::Success();
  std::vector<char> held(pairs.size() * page);
  for (int64_t lk = 0; lk < LK; ++lk) {
    char* head = base + lk * N * page;
    for (size_t i = 0; i < pairs.size(); ++i)
      std::memcpy(held.data() + i * page, head + pairs[i].first * page, page);
    for (size_t i = 0; i < pairs.size(); ++i)
      std::memcpy(head + pairs[i].second * page, held.data() + i * page, page);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedCpuWriteRows, WriteRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // pages
                                  .Arg<ffi::AnyBuffer>()         // rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // blk
                                  .Arg<ffi::Buffer<ffi::S32>>()  // off
                                  .Ret<ffi::AnyBuffer>());       // pages, aliased

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedCpuCopyPages, CopyPagesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // src
                                  .Arg<ffi::Buffer<ffi::S32>>()  // dst
                                  .Ret<ffi::AnyBuffer>());       // pages, aliased

#endif  // JAX_PAGED_PART_0
