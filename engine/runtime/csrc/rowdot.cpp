// Row-invariant linears for CPUs: y[m, o] = Σ_k x[m, k] · w[o, k], the weight stored at fp32,
// bf16, int8 (one scale per output row) or 4 bits (a scale and a minimum per 32 inputs), and the
// causal attention of a decoder read.
//
// Why: a verify reads 2–9 rows where plain decoding reads one. Speculative output equals plain
// decoding only if every row rounds exactly as it would alone, which BLAS kernels do not promise
// (they block, split and reorder the reduction by row count). Here every output element gets the
// same operations in the same order whatever the row count or the thread count: its weight row at
// fp32 (the format's dequantization), four 16-lane FMA chains over k in order, a fixed tree over
// chains and lanes (`tile`). A weight row is read once for every input row, so a 2–5 row read
// costs little more than a 1-row one. Compiled per machine (-march=native) by
// engine/runtime/rowdot.py.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

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
static inline v16 load_i8(const int8_t* p) {  // widened to int32 first: a direct conversion is scalarized
  // (gcc scalarizes a signed widening here; an unsigned one with the sign bit flipped is exact)
  v16u8 u; std::memcpy(&u, p, 16); return __builtin_convertvector(__builtin_convertvector(u ^ (uint8_t)0x80, v16i), v16) - 128.0f;
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

// R input rows against one weight row w [k]: y[r · ys] = Σ_i w[i] · x[r · k + i]. Every row gets
// the same operations in the same order whatever R (four 16-lane FMA chains over i, then
// `reduce`): R only decides how many rows share each load of w. Rows are taken four at a time
// (16 accumulators and the four weight vectors fit AVX-512's 32 registers).
template <int R>
static void tile(const float* w, const float* x, int64_t k, float* y, int64_t ys) {
  v16 acc[R][4] = {};
  for (int64_t i = 0; i < k; i += 64) {
    const v16 w0 = load_f32(w + i), w1 = load_f32(w + i + 16), w2 = load_f32(w + i + 32), w3 = load_f32(w + i + 48);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * k + i;
      acc[r][0] += w0 * load_f32(xr);
      acc[r][1] += w1 * load_f32(xr + 16);
      acc[r][2] += w2 * load_f32(xr + 32);
      acc[r][3] += w3 * load_f32(xr + 48);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ys] = reduce(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

static void rows_against(const float* w, const float* x, int64_t k, int64_t m, float* y, int64_t ys) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) tile<4>(w, x + r * k, k, y + r * ys, ys);
  switch (m - r) {
    case 3: tile<3>(w, x + r * k, k, y + r * ys, ys); break;
    case 2: tile<2>(w, x + r * k, k, y + r * ys, ys); break;
    case 1: tile<1>(w, x + r * k, k, y + r * ys, ys); break;
  }
}

// One weight row at fp32 into buf: the dequantization each format needs, done once per row and
// read by every input row (fp32 is read in place).
static inline const float* row_f32(const at::Tensor& w, int64_t o, int64_t k, float*) { return w.data_ptr<float>() + o * k; }
static inline const float* row_bf16(const at::Tensor& w, int64_t o, int64_t k, float* buf) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + o * k;
  for (int64_t i = 0; i < k; i += 16) { v16 v = load_bf16(p + i); std::memcpy(buf + i, &v, 64); }
  return buf;
}

constexpr int64_t AHEAD = 4;

template <typename Row>
static at::Tensor run(const at::Tensor& x, int64_t out, int64_t k, Row row, at::ScalarType out_type,
                      const char* base, int64_t row_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && k % 64 == 0, "rowdot: x must be [M, ", k, "], k % 64 == 0");
  at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const int64_t m = xf.size(0);
  at::Tensor y = at::empty({m, out}, xf.options());  // [M, O]
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, 64, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[8192];
    for (int64_t o = begin; o < end; ++o) {
      if (o + AHEAD < end)  // the row after next, line by line: one stream per thread is not enough here
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(base + (o + AHEAD) * row_bytes + b);
      const float* wr = row(o, buf);
      rows_against(wr, xp, k, m, yp + o, out);
    }
  });
  return out_type == at::kFloat ? y : y.to(out_type);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous(), "rowdot: fp32 weight");
  const int64_t k = w.size(1);
  return run(x, w.size(0), k, [&](int64_t o, float* b) { return row_f32(w, o, k, b); }, x.scalar_type(),
             (const char*)w.data_ptr(), k * 4);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(1) <= 8192, "rowdot: bf16 weight");
  const int64_t k = w.size(1);
  return run(x, w.size(0), k, [&](int64_t o, float* b) { return row_bf16(w, o, k, b); }, x.scalar_type(),
             (const char*)w.data_ptr(), k * 2);
}

// int8: w[o, k] = q[o, k] · scale[o]; the scale is applied to the row's dequantized weights so
// that one dot serves every format.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) <= 8192, "rowdot: int8 weight");
  const int64_t k = q.size(1);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  return run(x, q.size(0), k, [&](int64_t o, float* b) {
    const v16 s = v16{} + sp[o];
    for (int64_t i = 0; i < k; i += 16) { v16 v = load_i8(qp + o * k + i) * s; std::memcpy(b + i, &v, 64); }
    return (const float*)b;
  }, x.scalar_type(), (const char*)qp, k);
}

// 4 bits: per group of 32 inputs, byte j holds input j (low nibble) and input j + 16 (high);
// w = q · scale + minimum (scale_min [O, K/32, 2]).
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) * 2 <= 8192, "rowdot: int4 weight");
  const int64_t k = packed.size(1) * 2;
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sm = scale_min.data_ptr<float>();
  return run(x, packed.size(0), k, [&](int64_t o, float* b) {
    for (int64_t g = 0; g < k / 32; ++g) {
      v16u8 u; std::memcpy(&u, pp + o * (k / 2) + g * 16, 16);
      const float* p = sm + (o * (k / 32) + g) * 2;
      const v16 s = v16{} + p[0], mn = v16{} + p[1];
      v16 lo = from_u8(u & (uint8_t)15) * s + mn;
      v16 hi = from_u8(u >> 4) * s + mn;
      std::memcpy(b + g * 32, &lo, 64); std::memcpy(b + g * 32 + 16, &hi, 64);
    }
    return (const float*)b;
  }, x.scalar_type(), (const char*)pp, k / 2);
}


// Causal attention for S query rows over N keys, the last S of which are the rows' own: row i sees
// keys 0 … N − S + i. q [H, S, D], k and v [Hkv, N, D] (grouped heads: head h reads kv head
// h / (H / Hkv)) → [S, H, D]. Every (head, row) gets the same arithmetic whatever S: its scores by
// `tile<1>`, their maximum, exp and sum in key order, then Σ p_j · v_j in key order over
// the sum; a one-row plain step and a verify row at the same position compute the same bits.
static void attend_row(const float* q, const float* k, const float* v, int64_t n, int64_t d, float scale,
                       float* scores, float* out) {
  for (int64_t j = 0; j < n; ++j) tile<1>(k + j * d, q, d, scores + j, 1);
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) { scores[j] *= scale; mx = scores[j] > mx ? scores[j] : mx; }
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) { scores[j] = std::exp(scores[j] - mx); sum += scores[j]; }
  for (int64_t c = 0; c < d; c += 16) {
    v16 acc = {};
    for (int64_t j = 0; j < n; ++j) acc += (v16{} + scores[j]) * load_f32(v + j * d + c);
    acc /= (v16{} + sum);
    std::memcpy(out + c, &acc, 64);
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2) && q.size(2) % 64 == 0
              && q.size(0) % k.size(0) == 0 && q.size(1) <= k.size(1), "rowdot: attend shapes");
  at::Tensor qf = q.to(at::kFloat).contiguous(), kf = k.to(at::kFloat).contiguous(), vf = v.to(at::kFloat).contiguous();
  const int64_t h = q.size(0), s = q.size(1), d = q.size(2), n = k.size(1), group = h / k.size(0);
  at::Tensor out = at::empty({s, h, d}, qf.options());
  const float *qp = qf.data_ptr<float>(), *kp = kf.data_ptr<float>(), *vp = vf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, h * s, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(n);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t head = w / s, row = w % s, kv = head / group;
      attend_row(qp + (head * s + row) * d, kp + kv * n * d, vp + kv * n * d, n - s + row + 1, d, (float)scale,
                 scores.data(), op + (row * h + head) * d);
    }
  });
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

TORCH_LIBRARY(speclab_rowdot, m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor", linear_f32);
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor", linear_bf16);
  m.def("linear_int8(Tensor x, Tensor q, Tensor scale) -> Tensor", linear_int8);
  m.def("linear_int4(Tensor x, Tensor packed, Tensor scale_min) -> Tensor", linear_int4);
  m.def("attend(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", attend);
}
