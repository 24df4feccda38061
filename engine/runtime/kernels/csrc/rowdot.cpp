// Row-invariant linears for CPUs: y[m, o] = Σ_k x[m, k] · w[o, k], the weight stored at fp32,
// bf16, int8 (one scale per output row) or 4 bits (a scale and a minimum per 32 inputs), the
// causal attention of a decoder read, the decoder's norm, rotary and SwiGLU steps, and a Llama
// decoder layer composed of them in two calls (engine/runtime/row_llama.py).
//
// Why: a verify reads 2–9 rows where plain decoding reads one. Speculative output equals plain
// decoding only if every row rounds exactly as it would alone, which BLAS kernels do not promise
// (they block, split and reorder the reduction by row count). Here every output element gets the
// same operations in the same order whatever the row count or the thread count: its weight row at
// fp32 (the format's dequantization), four 16-lane FMA chains over k in order, a fixed tree over
// chains and lanes (`tile`, `gemm_tile`, `tile_q4`; bf16 with AVX512-BF16: `gemm_tile_dp`). A
// weight row is read once for up to `TILE` input rows. bf16 weights stored in AMX tiles take one
// fp32 chain per element instead (`matmul_amx`), up to 16 input rows a pass. Compiled per machine
// (-march=native) by engine/runtime/kernels/rowdot.py.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cmath>
#include <cassert>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__linux__)
#define ROWDOT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef int8_t v16i8 __attribute__((vector_size(16)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));

static inline v16 load_f32(const float* p) { v16 v; std::memcpy(&v, p, 64); return v; }
static inline v16 load_bf16(const uint16_t* p) {
  v16u16 u; std::memcpy(&u, p, 32);
  v16i i = __builtin_convertvector(u, v16i) << 16;  // bf16 bits are fp32's top half
  v16 f; std::memcpy(&f, &i, 64); return f;
}
static inline v16 load_i8(const int8_t* p) {  // exact: every int8 is an fp32
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  v16 v; std::memcpy(&v, &f, 64); return v;
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
  v16 v; std::memcpy(&v, &lo, 32); std::memcpy((char*)&v + 32, &hi, 32); return v;
#else  // gcc scalarizes a signed widening of generic vectors; an unsigned one with the sign bit flipped is exact
  v16u8 u; std::memcpy(&u, p, 16); return __builtin_convertvector(__builtin_convertvector(u ^ (uint8_t)0x80, v16i), v16) - 128.0f;
#endif
}
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i_ __attribute__((vector_size(64)));
// fp32 bits → bf16 bits (in the low half) as c10::BFloat16 rounds: to nearest even, NaN → 0x7FC0.
static inline v16u bf16_bits(v16u u) {
  const v16u r = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  v16 f; std::memcpy(&f, &u, 64);
  const v16i_ nan = f != f;  // all ones where NaN
  v16u m; std::memcpy(&m, &nan, 64);
  return (r & ~m) | (0x7FC0u & m);
}
static inline v16 from_u8(v16u8 u) { return __builtin_convertvector(__builtin_convertvector(u, v16i), v16); }

// The lanes of four chains summed by one fixed tree: chains pairwise, then halves, quarters, …
static inline float reduce(v16 a0, v16 a1, v16 a2, v16 a3) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v16 acc = (a0 + a1) + (a2 + a3);
  v8 h = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// R input rows x [R, k] against one weight row w [k]: y[r · ys] = Σ_i w[i] · x[r, i] by four
// 16-lane FMA chains over i (chain c takes i ≡ 16c … 16c + 15 mod 64) in order, then `reduce`: the
// order every linear element below and every attention score follows, whatever R.
static inline v16 load_w(const float* p) { return load_f32(p); }
static inline v16 load_w(const uint16_t* p) { return load_bf16(p); }
static inline v16 load_w(const int8_t* p) { return load_i8(p); }

// One block of 64 inputs (i … i + 63) into the four chains of R rows x [R, k]: acc[r][c] +=
// w_c · x[r, i + 16c …], chain c's lanes being inputs i + 16c … i + 16c + 15.
template <int R>
static inline void chains_block(v16 (&acc)[R][4], v16 w0, v16 w1, v16 w2, v16 w3, const float* x, int64_t k, int64_t i) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * k + i;
    acc[r][0] += w0 * load_f32(xr);
    acc[r][1] += w1 * load_f32(xr + 16);
    acc[r][2] += w2 * load_f32(xr + 32);
    acc[r][3] += w3 * load_f32(xr + 48);
  }
}

template <int R>
static inline void reduce_rows(v16 (&acc)[R][4], float* y, int64_t ys) {
  for (int r = 0; r < R; ++r) y[r * ys] = reduce(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

template <int R, typename W>
static void tile(const W* w, const float* x, int64_t k, float* y, int64_t ys) {
  v16 acc[R][4] = {};
  for (int64_t i = 0; i < k; i += 64)
    chains_block<R>(acc, load_w(w + i), load_w(w + i + 16), load_w(w + i + 32), load_w(w + i + 48), x, k, i);
  reduce_rows<R>(acc, y, ys);
}

// N weight rows against R input rows by `tile`'s chains: each weight vector loaded once serves R
// input rows, each input vector N weight rows, and a plain step (R = 1) keeps 4 · N chains in
// flight instead of 4. Each row's weights are read in order (a stream the prefetchers follow), and
// the row `ahead` elements on is prefetched into L2 at the same place as they go (0: none), so a
// verify's extra rows compute while the weights stream in. y[r · ys + n] gets `tile`'s arithmetic
// whatever N, R and the row's neighbours.
template <int N, int R, typename W>
static void gemm_tile(const W* const* w, const float* x, int64_t k, float* y, int64_t ys, int64_t ahead) {
  v16 acc[N][R][4] = {};
  for (int64_t i = 0; i < k; i += 64) {
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      if (ahead)
        for (int64_t b = 0; b < 64 * (int64_t)sizeof(W); b += 64) __builtin_prefetch((const char*)(w[n] + i + ahead) + b, 0, 2);
      chains_block<R>(acc[n], load_w(w[n] + i), load_w(w[n] + i + 16), load_w(w[n] + i + 32), load_w(w[n] + i + 48), x, k, i);
    }
  }
  for (int n = 0; n < N; ++n) reduce_rows<R>(acc[n], y + n, ys);
}

// Input rows per tile, and weight rows per tile at each input-row count: as many 4-chain
// accumulators as the vector registers hold beside the weight vectors (AVX-512: 32 registers of
// 16 lanes; AVX2: 16 of 8, a 16-lane vector taking two). Up to TILE rows (a verify of γ ≤ TILE − 1)
// read each weight row once. Which rows share a tile never changes an element's bits.
#if defined(__AVX512F__)
constexpr int TILE = 6;
constexpr int wide(int r) { return r <= 2 ? 2 : 1; }
#else
constexpr int TILE = 2;
constexpr int wide(int) { return 1; }
#endif
constexpr int64_t BW = 8;  // weight rows handed to `rows_against` at a time (a multiple of every `wide`)

// nw ≤ BW weight rows against R input rows: tiles (T::run, `gemm_tile` or `gemm_tile_dp`) of wide(R)
// weight rows, the rest one at a time.
template <class T, int R, typename W, typename X>
static void weight_block(const W* const* w, int64_t nw, const X* x, int64_t k, float* y, int64_t ys, int64_t ahead) {
  constexpr int N = wide(R);
  int64_t n = 0;
  for (; n + N <= nw; n += N) T::template run<N, R>(w + n, x, k, y + n, ys, ahead);
  for (; n < nw; ++n) T::template run<1, R>(w + n, x, k, y + n, ys, ahead);
}

// m input rows in tiles: f.template operator()<R>(r) for rows r … r + R − 1, TILE at a time, then
// the rest in one tile.
template <typename F>
static void by_tiles(int64_t m, F f) {
  int64_t r = 0;
  for (; r + TILE <= m; r += TILE) f.template operator()<TILE>(r);
  switch (m - r) {
    case 5: if constexpr (TILE > 5) f.template operator()<5>(r); break;
    case 4: if constexpr (TILE > 4) f.template operator()<4>(r); break;
    case 3: if constexpr (TILE > 3) f.template operator()<3>(r); break;
    case 2: if constexpr (TILE > 2) f.template operator()<2>(r); break;
    case 1: f.template operator()<1>(r); break;
  }
}

// nw weight rows against m input rows x [m, k]: y[r · ys + n] for every (r, n).
template <class T, typename W, typename X>
static void rows_against(const W* const* w, int64_t nw, const X* x, int64_t k, int64_t m, float* y, int64_t ys,
                         int64_t ahead) {
  by_tiles(m, [&]<int R>(int64_t r) { weight_block<T, R>(w, nw, x + r * k, k, y + r * ys, ys, ahead); });
}

struct Fma {  // fp32 inputs against fp32, bf16 or int8 weight rows
  template <int N, int R, typename W>
  static void run(const W* const* w, const float* x, int64_t k, float* y, int64_t ys, int64_t ahead) {
    gemm_tile<N, R>(w, x, k, y, ys, ahead);
  }
};

#ifdef __AVX512BF16__
// Where the CPU has AVX512-BF16 (Intel since Cooper Lake, AMD since Zen 4), a bf16 weight meets
// its input rounded to bf16 in `vdpbf16ps`: 32 products a step, each exact in fp32, summed into
// two 16-lane chains over k in order (the instruction's own fixed pairing), then `reduce`. A bf16
// model's activations are bf16 already (every module hands bf16 on), so rounding the input loses
// nothing there. Tiled as `gemm_tile`: the arithmetic is the same whatever the row count.
template <int N, int R>
static void gemm_tile_dp(const uint16_t* const* w, const uint16_t* x, int64_t k, float* y, int64_t ys, int64_t ahead) {
  __m512 acc[N][R][2];
  for (int n = 0; n < N; ++n)
    for (int r = 0; r < R; ++r) acc[n][r][0] = acc[n][r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 64) {
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w[n] + i), w1 = (__m512bh)_mm512_loadu_si512(w[n] + i + 32);
      if (ahead) {
        __builtin_prefetch(w[n] + i + ahead, 0, 2);
        __builtin_prefetch(w[n] + i + 32 + ahead, 0, 2);
      }
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * k + i;
        acc[n][r][0] = _mm512_dpbf16_ps(acc[n][r][0], w0, (__m512bh)_mm512_loadu_si512(xr));
        acc[n][r][1] = _mm512_dpbf16_ps(acc[n][r][1], w1, (__m512bh)_mm512_loadu_si512(xr + 32));
      }
    }
  }
  for (int n = 0; n < N; ++n)
    for (int r = 0; r < R; ++r) {
      v16 a0, a1; std::memcpy(&a0, &acc[n][r][0], 64); std::memcpy(&a1, &acc[n][r][1], 64);
      y[r * ys + n] = reduce(a0, a1, v16{}, v16{});
    }
}

struct Dp {  // bf16 inputs against bf16 weight rows
  template <int N, int R>
  static void run(const uint16_t* const* w, const uint16_t* x, int64_t k, float* y, int64_t ys, int64_t ahead) {
    gemm_tile_dp<N, R>(w, x, k, y, ys, ahead);
  }
};
#endif

// A linear's weight as the kernel reads it: its format, bytes and (int8/int4) scales.
enum Format { F32, BF16, BF16T, I8, I4 };  // BF16T: bf16 in AMX tiles (rowdot.py `tiled`, read by `matmul_amx`)
struct Weight {
  Format fmt; const char* base; const float* aux; int64_t out, k, row_bytes;
};

static bool amx_granted();

// The tensors of a RowLinear (engine/runtime/kernels/rowdot.py): fp32 or bf16 [O, K]; bf16 tiled for AMX
// [O/16, K/32, 16, 32]; int8 [O, K] and a scale per row; 4 bits packed [O, K/2] and scale_min
// [O, K/32, 2].
static Weight weight_of(at::TensorList t) {
  TORCH_CHECK(!t.empty() && t[0].is_contiguous(), "rowdot: a weight is one contiguous tensor");
  const at::Tensor& w = t[0];
  if (w.dim() == 4) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(2) == 16 && w.size(3) == 32 && amx_granted(),
                "rowdot: a tiled weight is bf16 [O/16, K/32, 16, 32], read where AMX is granted");
    return {BF16T, (const char*)w.data_ptr(), nullptr, w.size(0) * 16, w.size(1) * 32, w.size(1) * 64};
  }
  TORCH_CHECK(w.dim() == 2, "rowdot: a weight is [O, K]");
  const int64_t o = w.size(0);
  switch (w.scalar_type()) {
    case at::kFloat: return {F32, (const char*)w.data_ptr(), nullptr, o, w.size(1), w.size(1) * 4};
    case at::kBFloat16: return {BF16, (const char*)w.data_ptr(), nullptr, o, w.size(1), w.size(1) * 2};
    case at::kChar:
      TORCH_CHECK(t.size() == 2 && t[1].scalar_type() == at::kFloat && t[1].is_contiguous(), "rowdot: int8 scales");
      return {I8, (const char*)w.data_ptr(), t[1].data_ptr<float>(), o, w.size(1), w.size(1)};
    case at::kByte:
      TORCH_CHECK(t.size() == 2 && t[1].scalar_type() == at::kFloat && t[1].is_contiguous(), "rowdot: int4 scales");
      return {I4, (const char*)w.data_ptr(), t[1].data_ptr<float>(), o, w.size(1) * 2, w.size(1)};
    default: TORCH_CHECK(false, "rowdot: no weight format for ", w.scalar_type());
  }
}

// Weight row o as the tile reads it: fp32, bf16 and int8 in place (int8 scaled after the sum), 4 bits
// into buf (once per row, read by every input row).
template <Format F>
static inline auto row_of(const Weight& w, int64_t o, float* buf) {
  const int64_t k = w.k;
  if constexpr (F == F32) {
    return reinterpret_cast<const float*>(w.base) + o * k;
  } else if constexpr (F == BF16) {
    return reinterpret_cast<const uint16_t*>(w.base) + o * k;
  } else if constexpr (F == I8) {  // the codes, widened in registers; the row's scale multiplies the sum
    return reinterpret_cast<const int8_t*>(w.base) + o * k;
  } else {  // per group of 32 inputs, byte j holds input j (low nibble) and j + 16 (high); w = q · scale + min
    const uint8_t* pp = reinterpret_cast<const uint8_t*>(w.base) + o * (k / 2);
    for (int64_t g = 0; g < k / 32; ++g) {
      v16u8 u; std::memcpy(&u, pp + g * 16, 16);
      const float* p = w.aux + (o * (k / 32) + g) * 2;
      const v16 s = v16{} + p[0], mn = v16{} + p[1];
      v16 lo = from_u8(u & (uint8_t)15) * s + mn;
      v16 hi = from_u8(u >> 4) * s + mn;
      std::memcpy(buf + g * 32, &lo, 64); std::memcpy(buf + g * 32 + 16, &hi, 64);
    }
    return (const float*)buf;
  }
}

constexpr int64_t MAX_K = 8192;
// Weight rows between a row read and the one it prefetches: ~32 KB of the weight, at least 4 rows
// (into L2, which every x86 core has at 256 KB or more).
static inline int64_t ahead_rows(const Weight& w) { return std::max<int64_t>(4, 32768 / w.row_bytes); }
constexpr int64_t WBLOCK = 32;  // weight rows a long read keeps in cache while blocks of input rows pass
// Up to this many input rows (a chain's verify, a token tree's) meet each BW weight rows in turn,
// tile by tile, while those stay in L1: the weights stream from memory once, prefetched as they go.
constexpr int64_t FEW_ROWS = 3 * TILE;

// Widened weight rows, 64-byte aligned as the tiles read them (a split load costs two).
struct Buffer {
  float* p;
  explicit Buffer(int64_t n) : p(n ? static_cast<float*>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64)) : nullptr) {}
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// Runs `dot(o0, rows, n, r0, r1, ahead)` — input rows [r0, r1) against the n ≤ BW weight rows
// o0 … o0 + n − 1, as `row(o, buf)` gives them — for every output and every input row, over the
// output rows split between threads. A plain step or verify (m ≤ TILE) streams the weight rows in
// place, BW at a time, each read prefetching the row `ahead_rows` on (`ahead`: that distance in
// the row's elements); so does a token tree's read up to FEW_ROWS; a longer read (a prefill) goes
// a block of WBLOCK weight rows at a time, each
// met by every block of input rows while it stays in cache. Which rows share a pass never changes
// an element's arithmetic.
template <typename Row, typename Dot>
static void each_row(const Weight& w, int64_t m, Row row, Dot dot) {
  using Ptr = decltype(row(0, (float*)nullptr));
  const bool buffered = w.fmt == I4;  // 4 bits are widened into a buffer, a row at a time
  if (m <= FEW_ROWS && !buffered) {
    at::parallel_for(0, w.out, 64, [&](int64_t begin, int64_t end) {
      const int64_t ahead = ahead_rows(w) * w.k;
      Ptr rows[BW];
      for (int64_t o0 = begin; o0 < end; o0 += BW) {
        const int64_t n = std::min(BW, end - o0);
        for (int64_t i = 0; i < n; ++i) rows[i] = row(o0 + i, nullptr);
        dot(o0, rows, n, 0, m, ahead);
      }
    });
    return;
  }
  const int64_t rb = std::max<int64_t>(TILE, (8192 / w.k) / TILE * TILE);  // input rows per block: ~32 KB at fp32
  at::parallel_for(0, w.out, WBLOCK, [&](int64_t begin, int64_t end) {
    Buffer buf(buffered ? WBLOCK * w.k : 0);
    Ptr rows[WBLOCK];
    for (int64_t o0 = begin; o0 < end; o0 += WBLOCK) {
      const int64_t o1 = std::min(end, o0 + WBLOCK);
      for (int64_t o = o0; o < o1; ++o) rows[o - o0] = row(o, buf.p + (buffered ? (o - o0) * w.k : 0));
      for (int64_t r0 = 0; r0 < m; r0 += rb)
        for (int64_t o = o0; o < o1; o += BW)
          dot(o, rows + (o - o0), std::min(BW, o1 - o), r0, std::min(m, r0 + rb), 0);
    }
  });
}

// R input rows against one 4-bit weight row (packed pp, scale_min sm), widened in registers: each
// lane's w = q · scale + min as `row_of<I4>` computes it (one FMA), then `tile`'s chains and
// `reduce`. In a block of 64 inputs, group 2b's low nibbles are chain 0's lanes, its high nibbles
// chain 1's; group 2b + 1's, chains 2 and 3.
template <int R>
static void tile_q4(const uint8_t* pp, const float* sm, const float* x, int64_t k, float* y, int64_t ys) {
  v16 acc[R][4] = {};
  for (int64_t i = 0; i < k; i += 64) {
    const int64_t g = i / 32;
    v16u8 u0, u1; std::memcpy(&u0, pp + g * 16, 16); std::memcpy(&u1, pp + g * 16 + 16, 16);
    const v16 s0 = v16{} + sm[2 * g], m0 = v16{} + sm[2 * g + 1], s1 = v16{} + sm[2 * g + 2], m1 = v16{} + sm[2 * g + 3];
    const v16 w0 = from_u8(u0 & (uint8_t)15) * s0 + m0, w1 = from_u8(u0 >> 4) * s0 + m0;
    const v16 w2 = from_u8(u1 & (uint8_t)15) * s1 + m1, w3 = from_u8(u1 >> 4) * s1 + m1;
    chains_block<R>(acc, w0, w1, w2, w3, x, k, i);
  }
  reduce_rows<R>(acc, y, ys);
}

// A plain step or verify at 4 bits: each weight row widened in registers (`tile_q4`) and met by
// every input row at once, the packed row 4 on prefetched as it goes.
static void matmul_i4_few(const Weight& w, const float* x, int64_t m, float* y) {
  at::parallel_for(0, w.out, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      if (o + 4 < end)
        for (int64_t b = 0; b < w.row_bytes; b += 64) __builtin_prefetch(w.base + (o + 4) * w.row_bytes + b);
      const uint8_t* pp = reinterpret_cast<const uint8_t*>(w.base) + o * w.row_bytes;
      const float* sm = w.aux + o * (w.k / 32) * 2;
      by_tiles(m, [&]<int R>(int64_t r) { tile_q4<R>(pp, sm, x + r * w.k, w.k, y + r * w.out + o, w.out); });
    }
  });
}

// y [M, O] = x [M, K] · wᵀ, every element by `gemm_tile` (fp32 in and out).
template <Format F>
static void matmul_as(const Weight& w, const float* x, int64_t m, float* y) {
  if constexpr (F == I4)
    if (m <= TILE) return matmul_i4_few(w, x, m, y);
  each_row(w, m, [&](int64_t o, float* buf) { return row_of<F>(w, o, buf); },
           [&](int64_t o, auto* rows, int64_t n, int64_t r0, int64_t r1, int64_t ahead) {
             rows_against<Fma>(rows, n, x + r0 * w.k, w.k, r1 - r0, y + r0 * w.out + o, w.out, ahead);
             if constexpr (F == I8)  // y[r, o] = scale[o] · Σ_i q[o, i] · x[r, i]
               for (int64_t r = r0; r < r1; ++r)
                 for (int64_t i = 0; i < n; ++i) y[r * w.out + o + i] *= w.aux[o + i];
           });
}

// x [n] (n a multiple of 16) at bf16 as c10::BFloat16 rounds it, for the bf16 dot products.
static void to_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    v16u u; std::memcpy(&u, x + i, 64);
    const v16u16 b = __builtin_convertvector(bf16_bits(u), v16u16);
    std::memcpy(out + i, &b, 32);
  }
}

#ifdef ROWDOT_AMX
// Where the CPU has AMX (Intel since Sapphire Rapids) and Linux grants this process the tile
// state, a bf16 weight is stored in tiles (engine/runtime/kernels/rowdot.py `tiled`): 16 output rows × 32
// inputs, 1 KB contiguous, row-block by row-block, so a read streams the weight in order. The
// product is yᵀ = W · xᵀ: `tdpbf16ps` with A = a 16 × 32 tile of W, B = 16 input pairs of up to 16
// input rows (x at bf16, pairs interleaved as the instruction takes them), C = 16 outputs × R
// rows at fp32. Each output element is one fp32 chain over k in order, 32 inputs an instruction:
// its arithmetic depends on neither R nor which rows share a tile, so a verify of up to 16 rows
// costs about one pass over the weights, and a one-row plain step is the same code. Tiles 0–3 are
// C (64 outputs), 4 is B, 5–7 take A in turn.
static bool amx_granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct AmxTiles {  // this thread's tile configuration for R input rows; the state is released after
  struct alignas(64) Config { uint8_t palette, start_row, pad[14]; uint16_t colsb[16]; uint8_t rows[16]; };
  int r = 0;
  void set(int rows) {
    if (rows == r) return;
    Config c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = t < 5 ? rows * 4 : 64; }
    _tile_loadconfig(&c);
    r = rows;
  }
  ~AmxTiles() { if (r) _tile_release(); }
};

// NJ ≤ 4 blocks of 16 output rows (w: the first block's tiles) against R ≤ 16 input rows (xp: [K/2,
// R] bf16 pairs) → c [16 · NJ, R].
template <int NJ>
static void amx_blocks(const uint16_t* w, int64_t k, const uint32_t* xp, int r, float* c) {
  _tile_zero(0);
  if constexpr (NJ > 1) _tile_zero(1);
  if constexpr (NJ > 2) _tile_zero(2);
  if constexpr (NJ > 3) _tile_zero(3);
  const int64_t block = 16 * k;  // one block of 16 rows, in elements
  for (int64_t i = 0; i < k; i += 32) {
    _tile_loadd(4, xp + (i / 2) * r, r * 4);
    _tile_loadd(5, w + i * 16, 64);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (NJ > 1) { _tile_loadd(6, w + block + i * 16, 64); _tile_dpbf16ps(1, 6, 4); }
    if constexpr (NJ > 2) { _tile_loadd(7, w + 2 * block + i * 16, 64); _tile_dpbf16ps(2, 7, 4); }
    if constexpr (NJ > 3) { _tile_loadd(5, w + 3 * block + i * 16, 64); _tile_dpbf16ps(3, 5, 4); }
  }
  _tile_stored(0, c, r * 4);
  if constexpr (NJ > 1) _tile_stored(1, c + 16 * r, r * 4);
  if constexpr (NJ > 2) _tile_stored(2, c + 32 * r, r * 4);
  if constexpr (NJ > 3) _tile_stored(3, c + 48 * r, r * 4);
}

static void matmul_amx(const Weight& w, const float* x, int64_t m, float* y) {
  const int64_t k = w.k;
  std::vector<uint16_t> xb(m * k);  // the input at bf16
  to_bf16(x, m * k, xb.data());
  std::vector<uint32_t> xp(m * k / 2);  // per 16 input rows from r0: [K/2, R] pairs, at r0 · K/2
  for (int64_t r0 = 0; r0 < m; r0 += 16) {
    const int64_t rn = std::min<int64_t>(16, m - r0);
    for (int64_t r = 0; r < rn; ++r) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(xb.data() + (r0 + r) * k);
      for (int64_t p = 0; p < k / 2; ++p) xp[r0 * k / 2 + p * rn + r] = row[p];
    }
  }
  const uint16_t* base = reinterpret_cast<const uint16_t*>(w.base);
  at::parallel_for(0, w.out / 16, 4, [&](int64_t begin, int64_t end) {
    AmxTiles tiles;
    alignas(64) float c[64 * 16];
    for (int64_t b = begin; b < end; b += 4) {  // b: a block of 16 output rows
      const int nj = (int)std::min<int64_t>(4, end - b);
      const uint16_t* wb = base + b * 16 * k;
      for (int64_t r0 = 0; r0 < m; r0 += 16) {  // a prefill meets the blocks while they are in cache
        const int rn = (int)std::min<int64_t>(16, m - r0);
        tiles.set(rn);
        const uint32_t* xr = xp.data() + r0 * k / 2;
        switch (nj) {
          case 4: amx_blocks<4>(wb, k, xr, rn, c); break;
          case 3: amx_blocks<3>(wb, k, xr, rn, c); break;
          case 2: amx_blocks<2>(wb, k, xr, rn, c); break;
          default: amx_blocks<1>(wb, k, xr, rn, c);
        }
        for (int i = 0; i < 16 * nj; ++i)
          for (int r = 0; r < rn; ++r) y[(r0 + r) * w.out + b * 16 + i] = c[i * rn + r];
      }
    }
  });
}
#else
static bool amx_granted() { return false; }
static void matmul_amx(const Weight&, const float*, int64_t, float*) { TORCH_CHECK(false, "rowdot: no AMX here"); }
#endif

static void matmul(const Weight& w, const float* x, int64_t m, float* y) {
  TORCH_CHECK(w.k % 64 == 0 && w.k <= MAX_K, "rowdot: K must be a multiple of 64, at most ", MAX_K);
  switch (w.fmt) {
    case F32: return matmul_as<F32>(w, x, m, y);
    case BF16:
#ifdef __AVX512BF16__
    {
      std::vector<uint16_t> xb(m * w.k);  // the input at bf16 (k is a multiple of 64)
      to_bf16(x, m * w.k, xb.data());
      each_row(w, m, [&](int64_t o, float*) { return reinterpret_cast<const uint16_t*>(w.base) + o * w.k; },
               [&](int64_t o, const uint16_t* const* rows, int64_t n, int64_t r0, int64_t r1, int64_t ahead) {
                 rows_against<Dp>(rows, n, xb.data() + r0 * w.k, w.k, r1 - r0, y + r0 * w.out + o, w.out, ahead);
               });
      return;
    }
#else
      return matmul_as<BF16>(w, x, m, y);
#endif
    case BF16T: return matmul_amx(w, x, m, y);
    case I8: return matmul_as<I8>(w, x, m, y);
    case I4: return matmul_as<I4>(w, x, m, y);
  }
}

// -- the activations' rounding and the decoder's elementwise steps ----------------------------------
// Values live in fp32 buffers; where HF's module would hand a bf16 model a bf16 tensor, they are
// rounded to bf16 (round to nearest even, as torch's conversion) in place. Each step is one
// out-of-line function over one row, so every row of every read, and the module-by-module read
// (the RowNorm/RowMLP/RowAttention forwards) and the fused one (`layer_pre`/`layer_post`), run
// the very same machine code.
static void round_to(at::ScalarType t, float* p, int64_t n) {
  if (t != at::kBFloat16) return;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16u u; std::memcpy(&u, p + i, 64);
    u = bf16_bits(u) << 16;
    std::memcpy(p + i, &u, 64);
  }
  for (; i < n; ++i) p[i] = static_cast<float>(c10::BFloat16(p[i]));
}

// RMSNorm: y = w · (x / sqrt(mean(x²) + eps)), the normalized x rounded first (HF's order).
__attribute__((noinline)) static void norm_row(const float* x, const float* w, int64_t n, float eps,
                                               at::ScalarType t, float* y) {
  v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t i = 0; i < n; i += 64) {
    const v16 x0 = load_f32(x + i), x1 = load_f32(x + i + 16), x2 = load_f32(x + i + 32), x3 = load_f32(x + i + 48);
    a0 += x0 * x0; a1 += x1 * x1; a2 += x2 * x2; a3 += x3 * x3;
  }
  const float r = 1.0f / std::sqrt(reduce(a0, a1, a2, a3) / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r;
  round_to(t, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * y[i];
  round_to(t, y, n);
}

// Rotary embedding of one position's heads, t [heads, D] in place: t·cos + rotate_half(t)·sin.
__attribute__((noinline)) static void rope_row(float* t, const float* cos, const float* sin, int64_t heads,
                                               int64_t d, at::ScalarType ty) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* p = t + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = p[i], b = p[i + half];
      p[i] = a * cos[i] - b * sin[i];
      p[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
  round_to(ty, t, heads * d);
}

// SwiGLU's middle: silu(g) · u.
__attribute__((noinline)) static void silu_mul_row(const float* g, const float* u, int64_t n, at::ScalarType t,
                                                   float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  round_to(t, y, n);
}

__attribute__((noinline)) static void add_row(float* x, const float* y, int64_t n, at::ScalarType t) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
  round_to(t, x, n);
}

// Causal attention for S query rows over N keys, the last S of which are the rows' own: row i sees
// keys 0 … N − S + i. Every (head, row) gets the same arithmetic whatever S: its scores by
// `tile<1>`, their maximum, exp and sum in key order, then Σ p_j · v_j in key order over the sum;
// a one-row plain step and a verify row at the same position compute the same bits.
// `key(j)` is the index of the j-th key the row reads: j itself for a causal row, and for a token
// tree's row the cached context followed by its ancestors and itself (in row order, which is the
// order a chain read over that path holds them in), so a tree row's bits are that chain row's.
template <typename KV, typename Key>
static void attend_row(const float* q, const KV* k, const KV* v, int64_t n, int64_t d, float scale,
                       float* scores, float* out, Key key) {
  for (int64_t j = 0; j < n; ++j) tile<1>(k + key(j) * d, q, d, scores + j, 1);
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) { scores[j] *= scale; mx = scores[j] > mx ? scores[j] : mx; }
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) { scores[j] = std::exp(scores[j] - mx); sum += scores[j]; }
  for (int64_t c = 0; c < d; c += 64) {  // four 16-lane columns at once: four chains in flight, each in key order
    v16 acc[4] = {};
    for (int64_t j = 0; j < n; ++j) {
      const v16 p = v16{} + scores[j];
      const KV* vj = v + key(j) * d + c;
      acc[0] += p * load_w(vj);
      acc[1] += p * load_w(vj + 16);
      acc[2] += p * load_w(vj + 32);
      acc[3] += p * load_w(vj + 48);
    }
    for (int i = 0; i < 4; ++i) {
      acc[i] /= (v16{} + sum);
      std::memcpy(out + c + 16 * i, &acc[i], 64);
    }
  }
}

// q [H, S, D] (fp32, contiguous), k/v [Hkv, N, D] (fp32 or bf16: a bf16 cache is read in place,
// widened in registers, the same values a copy at fp32 would hold) with rows of D contiguous and
// heads `kv_stride` apart (a cache's view) → out [S, H, D]; head h reads kv head h / (H / Hkv).
// allowed: null for causal rows, else [S, T] over the last T ≥ S keys (a token tree's rows, those
// cached before this read and the read's own): row r reads key N − T + c where allowed[r·T + c],
// after the N − T keys every row reads.
template <typename KV>
static void attend_into(const float* q, const KV* k, const KV* v, int64_t kv_stride, int64_t h, int64_t hkv,
                        int64_t s, int64_t n, int64_t d, float scale, at::ScalarType t, const uint8_t* allowed,
                        int64_t tree_keys, float* out) {
  const int64_t group = h / hkv, past = allowed ? n - tree_keys : n - s;
  std::vector<std::vector<int64_t>> tails(allowed ? s : 0);  // per tree row: the tree's keys it sees
  for (int64_t r = 0; r < (int64_t)tails.size(); ++r)
    for (int64_t c = 0; c < tree_keys; ++c)
      if (allowed[r * tree_keys + c]) tails[r].push_back(past + c);
  at::parallel_for(0, h * s, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(n);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t head = w / s, row = w % s, kv = head / group;
      float* o = out + (row * h + head) * d;
      const KV *kh = k + kv * kv_stride, *vh = v + kv * kv_stride;
      const float* qr = q + (head * s + row) * d;
      if (!allowed) {
        attend_row(qr, kh, vh, past + row + 1, d, scale, scores.data(), o, [](int64_t j) { return j; });
      } else {
        const int64_t* tail = tails[row].data();
        attend_row(qr, kh, vh, past + (int64_t)tails[row].size(), d, scale, scores.data(), o,
                   [past, tail](int64_t j) { return j < past ? j : tail[j - past]; });
      }
      round_to(t, o, d);
    }
  });
}

// -- torch-facing ops --------------------------------------------------------------------------------
static at::Tensor floats(const at::Tensor& x) { return x.to(at::kFloat).contiguous(); }

// Keys and values [Hkv, N, D] as attend_into reads them: a cache's fp32 or bf16 view in place
// (rows of D contiguous, both with one head stride), else copies at fp32.
static void attend_kv(const float* q, const at::Tensor& keys, const at::Tensor& values, int64_t h, int64_t s,
                      float scale, at::ScalarType t, const uint8_t* allowed, int64_t tree_keys, float* out) {
  const int64_t d = keys.size(2), n = keys.size(1), hkv = keys.size(0);
  auto in_place = [&](const at::Tensor& x) { return x.stride(2) == 1 && x.stride(1) == d; };
  const auto kt = keys.scalar_type();
  if (kt == values.scalar_type() && (kt == at::kFloat || kt == at::kBFloat16) && in_place(keys) && in_place(values)
      && keys.stride(0) == values.stride(0)) {
    if (kt == at::kFloat)
      return attend_into(q, keys.data_ptr<float>(), values.data_ptr<float>(), keys.stride(0), h, hkv, s, n, d, scale, t, allowed, tree_keys, out);
    return attend_into(q, reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()), keys.stride(0), h, hkv, s, n,
                       d, scale, t, allowed, tree_keys, out);
  }
  at::Tensor kf = floats(keys), vf = floats(values);
  attend_into(q, kf.data_ptr<float>(), vf.data_ptr<float>(), n * d, h, hkv, s, n, d, scale, t, allowed, tree_keys, out);
}

// The bf16 or fp32 tensor a module hands on, from the fp32 buffer it was computed in.
static at::Tensor as(const at::Tensor& y, at::ScalarType t) { return t == at::kFloat ? y : y.to(t); }

static at::Tensor linear_any(const at::Tensor& x, at::TensorList w) {
  const Weight wt = weight_of(w);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == wt.k, "rowdot: x must be [M, ", wt.k, "]");
  at::Tensor xf = floats(x);  // [M, K]
  at::Tensor y = at::empty({xf.size(0), wt.out}, xf.options());  // [M, O]
  matmul(wt, xf.data_ptr<float>(), xf.size(0), y.data_ptr<float>());
  round_to(x.scalar_type(), y.data_ptr<float>(), y.numel());
  return as(y, x.scalar_type());
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "rowdot: fp32 weight");
  return linear_any(x, {w});
}
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "rowdot: bf16 weight");
  return linear_any(x, {w});
}
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == at::kChar, "rowdot: int8 weight");
  return linear_any(x, {q, scale});
}
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min) {
  TORCH_CHECK(packed.scalar_type() == at::kByte, "rowdot: int4 weight");
  return linear_any(x, {packed, scale_min});
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2) && q.size(2) % 64 == 0
              && q.size(0) % k.size(0) == 0 && q.size(1) <= k.size(1), "rowdot: attend shapes");
  at::Tensor qf = floats(q);
  const int64_t h = q.size(0), s = q.size(1), d = q.size(2);
  at::Tensor out = at::empty({s, h, d}, qf.options());
  attend_kv(qf.data_ptr<float>(), k, v, h, s, (float)scale, q.scalar_type(), nullptr, 0, out.data_ptr<float>());
  return as(out, q.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0) && x.size(1) % 64 == 0, "rowdot: rms_norm shapes");
  at::Tensor xf = floats(x), wf = floats(w);
  at::Tensor y = at::empty_like(xf);
  const int64_t n = xf.size(1);
  for (int64_t r = 0; r < xf.size(0); ++r)
    norm_row(xf.data_ptr<float>() + r * n, wf.data_ptr<float>(), n, (float)eps, x.scalar_type(), y.data_ptr<float>() + r * n);
  return as(y, x.scalar_type());
}

// t [S, heads, D]; cos and sin [S, D].
at::Tensor rope(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(t.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == t.size(0)
              && cos.size(1) == t.size(2) && t.size(2) % 2 == 0, "rowdot: rope shapes");
  at::Tensor y = t.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
  at::Tensor c = floats(cos), s = floats(sin);
  const int64_t heads = t.size(1), d = t.size(2);
  for (int64_t r = 0; r < t.size(0); ++r)
    rope_row(y.data_ptr<float>() + r * heads * d, c.data_ptr<float>() + r * d, s.data_ptr<float>() + r * d, heads, d,
             t.scalar_type());
  return as(y, t.scalar_type());
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type(), "rowdot: silu_mul shapes");
  at::Tensor gf = floats(g).view({-1, g.size(-1)}), uf = floats(u).view({-1, g.size(-1)});
  at::Tensor y = at::empty_like(gf);
  const int64_t n = gf.size(1);
  for (int64_t r = 0; r < gf.size(0); ++r)
    silu_mul_row(gf.data_ptr<float>() + r * n, uf.data_ptr<float>() + r * n, n, g.scalar_type(), y.data_ptr<float>() + r * n);
  return as(y, g.scalar_type()).view(g.sizes());
}

// -- a decoder layer in two calls ---------------------------------------------------------------------
// The module-by-module read above, composed without a return to Python between steps (a plain CPU
// step's ~25 small torch calls per layer cost a quarter of its time). layer_pre: x [S, H] →
// norm → q, k, v → rotary, as q [Hq, S, D], k and v [Hkv, S, D] (the cache's layout). layer_post:
// attention over the cache's keys and values, o_proj, the residual, norm, gate/up, silu·mul,
// down, the residual → the next x [S, H]. Every value rounds where the modules' would.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_pre(const at::Tensor& x, const at::Tensor& ln, double eps,
                                                         at::TensorList wq, at::TensorList wk, at::TensorList wv,
                                                         const at::Tensor& cos, const at::Tensor& sin) {
  const at::ScalarType t = x.scalar_type();
  const Weight q = weight_of(wq), k = weight_of(wk), v = weight_of(wv);
  const int64_t s = x.size(0), n = x.size(1), d = cos.size(1);
  TORCH_CHECK(x.dim() == 2 && q.k == n && k.k == n && v.k == n && cos.size(0) == s && n % 64 == 0, "rowdot: layer_pre shapes");
  at::Tensor xf = floats(x), lnf = floats(ln), cf = floats(cos), sf = floats(sin);
  at::Tensor h = at::empty_like(xf);
  for (int64_t r = 0; r < s; ++r)
    norm_row(xf.data_ptr<float>() + r * n, lnf.data_ptr<float>(), n, (float)eps, t, h.data_ptr<float>() + r * n);
  at::Tensor out[3];
  const Weight* ws[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    at::Tensor y = at::empty({s, ws[i]->out}, xf.options());  // [S, heads · D]
    matmul(*ws[i], h.data_ptr<float>(), s, y.data_ptr<float>());
    round_to(t, y.data_ptr<float>(), y.numel());
    if (i < 2)
      for (int64_t r = 0; r < s; ++r)
        rope_row(y.data_ptr<float>() + r * ws[i]->out, cf.data_ptr<float>() + r * d, sf.data_ptr<float>() + r * d,
                 ws[i]->out / d, d, t);
    out[i] = as(y.view({s, ws[i]->out / d, d}).transpose(0, 1).contiguous(), t);  // [heads, S, D]
  }
  return {out[0], out[1], out[2]};
}

at::Tensor layer_post(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                      double scale, at::TensorList wo, const at::Tensor& ln, double eps, at::TensorList wg,
                      at::TensorList wu, at::TensorList wd, const c10::optional<at::Tensor>& allowed) {
  const at::ScalarType t = x.scalar_type();
  const Weight o = weight_of(wo), g = weight_of(wg), u = weight_of(wu), dn = weight_of(wd);
  const int64_t s = x.size(0), n = x.size(1), h = q.size(0), d = q.size(2);
  TORCH_CHECK(x.dim() == 2 && q.dim() == 3 && q.size(1) == s && o.k == h * d && o.out == n && g.k == n && u.out == g.out
              && dn.k == g.out && dn.out == n && keys.sizes() == values.sizes() && h % keys.size(0) == 0, "rowdot: layer_post shapes");
  at::Tensor xf = x.to(at::kFloat, false, /*copy=*/true).contiguous(), qf = floats(q);  // xf: the residual stream, updated
  at::Tensor a = at::empty({s, h * d}, xf.options());  // [S, H · D]
  at::Tensor tree;  // [S, T] uint8: a token tree's mask over its last T keys (none: causal)
  if (allowed.has_value()) {
    tree = allowed->to(at::kByte).contiguous();
    TORCH_CHECK(tree.dim() == 2 && tree.size(0) == s && tree.size(1) >= s && tree.size(1) <= keys.size(1),
                "rowdot: layer_post allowed must be [S, T], S ≤ T ≤ the keys");
  }
  attend_kv(qf.data_ptr<float>(), keys, values, h, s, (float)scale, t, tree.defined() ? tree.data_ptr<uint8_t>() : nullptr,
            tree.defined() ? tree.size(1) : 0, a.data_ptr<float>());
  at::Tensor y = at::empty({s, n}, xf.options());
  matmul(o, a.data_ptr<float>(), s, y.data_ptr<float>());
  round_to(t, y.data_ptr<float>(), y.numel());
  float *xp = xf.data_ptr<float>(), *yp = y.data_ptr<float>();
  for (int64_t r = 0; r < s; ++r) add_row(xp + r * n, yp + r * n, n, t);
  at::Tensor lnf = floats(ln), hn = at::empty_like(xf);
  for (int64_t r = 0; r < s; ++r) norm_row(xp + r * n, lnf.data_ptr<float>(), n, (float)eps, t, hn.data_ptr<float>() + r * n);
  const int64_t m = g.out;
  at::Tensor gate = at::empty({s, m}, xf.options()), up = at::empty({s, m}, xf.options());
  matmul(g, hn.data_ptr<float>(), s, gate.data_ptr<float>());
  matmul(u, hn.data_ptr<float>(), s, up.data_ptr<float>());
  round_to(t, gate.data_ptr<float>(), gate.numel());
  round_to(t, up.data_ptr<float>(), up.numel());
  float *gp = gate.data_ptr<float>(), *up_ = up.data_ptr<float>();
  for (int64_t r = 0; r < s; ++r) silu_mul_row(gp + r * m, up_ + r * m, m, t, gp + r * m);
  matmul(dn, gp, s, yp);
  round_to(t, yp, y.numel());
  for (int64_t r = 0; r < s; ++r) add_row(xp + r * n, yp + r * n, n, t);
  return as(xf, t);
}

bool amx() { return amx_granted(); }

TORCH_LIBRARY(speclab_rowdot, m) {
  m.def("amx() -> bool", amx);
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor", linear_f32);
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor", linear_bf16);
  m.def("linear_int8(Tensor x, Tensor q, Tensor scale) -> Tensor", linear_int8);
  m.def("linear_int4(Tensor x, Tensor packed, Tensor scale_min) -> Tensor", linear_int4);
  m.def("attend(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", attend);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", rms_norm);
  m.def("rope(Tensor t, Tensor cos, Tensor sin) -> Tensor", rope);
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor", silu_mul);
  m.def("layer_pre(Tensor x, Tensor ln, float eps, Tensor[] wq, Tensor[] wk, Tensor[] wv, Tensor cos, Tensor sin)"
        " -> (Tensor, Tensor, Tensor)", layer_pre);
  m.def("layer_post(Tensor x, Tensor q, Tensor keys, Tensor values, float scale, Tensor[] wo, Tensor ln, float eps,"
        " Tensor[] wg, Tensor[] wu, Tensor[] wd, Tensor? allowed=None) -> Tensor", layer_post);
}
