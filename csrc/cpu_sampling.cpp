// Fused inverse-CDF sampling on the CPU: temperature, min-p, top-k, top-p, CDF, choice.
//
// One row per task of ATen's parallel_for (torch's own OpenMP pool); with fewer rows than
// threads, one row at a time with its block passes split over the threads. Per row:
//   1. max logit m (vectorised; NaN counted);
//   2. thresholds in logit space: min-p keeps x >= m + T*log(min_p) (p_j/p_max >= min_p),
//      top-k keeps x >= the k-th largest (ties kept), exactly vLLM's rules
//      (vllm/v1/sample/logits_processor/builtin.py, ops/topk_topp_sampler.py). With
//      top-k the k-th largest comes from size-k heaps (one per range of blocks) or, for
//      k > HEAP_K, by selection in a bracket of counted pivots, and only the tokens at or
//      above it, compacted, are exponentiated;
//   3. weights w_j = exp((x_j - m)/T) for kept tokens (float, vectorised polynomial exp),
//      summed per block of BLOCK tokens; with top-p also the mass above eight pivots. The
//      weights are not stored: a pass that needs them recomputes them from the row, so the
//      row is the only array read (the memory traffic is what the time is);
//   4. top-p (if p < 1): over the kept tokens in ascending (logit, id) order, drop
//      those whose cumulative probability is <= 1 - p, keeping the largest (vLLM). No
//      sort: on the dense row a search over the candidates between two pivots finds the
//      cut (apply_top_p_dense); after top-k, the <= k kept tokens are ordered by a partial
//      sort (apply_top_p);
//   5. the CDF walk in the chosen order: the first token whose cumulative weight
//      exceeds u * total; in token-id order whole blocks are skipped by their sums.
// A row with NaN or no finite logit gets token -1 (the Python caller raises ValueError).
// Returns the token, its interval start F(token-)/total and width w/total, which the
// residual carry uses (../shared/design/qmc-math.md §1-2).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 1024;

// exp(x) for x <= 0: 2^t with t = x*log2(e) split as n + f, f in [-0.5, 0.5],
// 2^f by its degree-7 Taylor polynomial (relative error < 2e-9), 2^n by exponent bits.
// Branch-free so that GCC vectorises the loop that calls it.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  // Round to nearest by the 1.5*2^23 trick (exact for |t| < 2^22): plain arithmetic
  // vectorises, where nearbyint would not without -ffast-math.
  const float n = (t + 12582912.0f) - 12582912.0f;
  const float f = (t - n) * 0.693147180559945309f;  // in [-0.347, 0.347]
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct RowResult {
  int64_t token;
  double start;
  double prob;
};

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Scratch buffers of one thread, reused across its rows.
struct Scratch {
  std::vector<float> wt, cx, cw, dx, dw, block_max, block_min, pivot_mass;
  std::vector<double> block_sum, block_base;
  std::vector<int64_t> idx, range_count;
  std::vector<std::vector<float>> heaps;  // top-k: one per range of blocks
  std::vector<int32_t> ci, block_nans, pivot_count;
};

// A token's weight exp((x - m)/T); 0 below the min-p cut, for -inf, and where float32
// underflows. The row's weights are never stored: each pass recomputes those it needs. (A
// pass vectorised differently may round a weight differently where GCC contracts to FMA;
// the walk's sums tolerate that, as they tolerate the order of summation.)
inline float weight_of(float x, float m, float inv_t, float min_p_cut) {
  const float z = (x - m) * inv_t;
  const float e = exp_nonpositive(z);
  const bool keep = (x >= min_p_cut) & (z > -87.0f);  // bitwise: no branch, so it vectorises
  return keep ? e : 0.0f;
}

// The per-block loops, as functions of plain values and unaliased pointers, not inlined: inside
// the lambdas of over_blocks, captured references kept GCC from vectorising them (~8x slower),
// and inlined there GCC left the weights' loop scalar once the lambda grew (~6x slower).

__attribute__((noinline)) void block_extremes(const float* __restrict x, int64_t lo, int64_t hi, float& max_out, float& min_out,
                    int32_t& nans_out) {
  float m = NEG_INF, x_min = std::numeric_limits<float>::infinity();
  int32_t nans = 0;
#pragma omp simd reduction(max : m) reduction(min : x_min) reduction(+ : nans)
  for (int64_t j = lo; j < hi; ++j) {
    const float xj = x[j];
    m = xj > m ? xj : m;
    x_min = xj < x_min ? xj : x_min;
    nans += xj != xj;
  }
  max_out = m, min_out = x_min, nans_out = nans;
}

// w_j = weight_of(x_j) for j in [lo, hi); returns their float sum.
__attribute__((noinline)) float block_weights(const float* __restrict x, float* __restrict w, int64_t lo, int64_t hi, float m, float inv_t,
                    float min_p_cut) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = lo; j < hi; ++j) {
    const float wj = weight_of(x[j], m, inv_t, min_p_cut);
    w[j] = wj;
    s += wj;
  }
  return s;
}

// The mass of the weights above each of four pivots t[0] > ... > t[3] (a zero weight adds nothing).
// Four at a time: with more, the thresholds and sums no longer fit AVX2's 16 registers.
__attribute__((noinline)) void block_pivot_sums(const float* __restrict x, const float* __restrict w, int64_t len,
                                                const float* __restrict t, float* __restrict mass) {
  const float t0 = t[0], t1 = t[1], t2 = t[2], t3 = t[3];
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t j = 0; j < len; ++j) {
    const float xj = x[j], wj = w[j];
    a0 += xj > t0 ? wj : 0.0f;
    a1 += xj > t1 ? wj : 0.0f;
    a2 += xj > t2 ? wj : 0.0f;
    a3 += xj > t3 ? wj : 0.0f;
  }
  mass[0] = a0, mass[1] = a1, mass[2] = a2, mass[3] = a3;
}

// The count of tokens above each of four pivots t[0] > ... > t[3].
__attribute__((noinline)) void block_pivot_counts(const float* __restrict x, int64_t len, const float* __restrict t,
                                                  int32_t* __restrict count) {
  const float t0 = t[0], t1 = t[1], t2 = t[2], t3 = t[3];
  int32_t c0 = 0, c1 = 0, c2 = 0, c3 = 0;
#pragma omp simd reduction(+ : c0, c1, c2, c3)
  for (int64_t j = 0; j < len; ++j) {
    const float xj = x[j];
    c0 += xj > t0;
    c1 += xj > t1;
    c2 += xj > t2;
    c3 += xj > t3;
  }
  count[0] = c0, count[1] = c1, count[2] = c2, count[3] = c3;
}

// fn(first_block, end_block) over [0, blocks): split across torch's threads when called outside
// a parallel region (a batch smaller than the thread count, rows one after another), inline
// within one (rows in parallel). Every per-block result is combined in block order, so the
// numbers do not depend on the split.
template <typename F>
void over_blocks(int64_t blocks, const F& fn) {
  at::parallel_for(0, blocks, 1, fn);
}

// Top-p pivots in units of T below the largest logit: the mass above each is summed in the
// weights' pass, so the search starts from a bracket instead of the whole row. Eight, closest
// where cuts fall for flat rows (T near 1, p 0.9-0.95: 5-9 units down): the candidates between
// two pivots are what the search compacts and scans, and they multiply going down.
constexpr int PIVOTS = 8;
constexpr float PIVOT_Z[PIVOTS] = {-1.0f, -2.0f, -3.0f, -4.5f, -6.0f, -7.5f, -9.0f, -12.0f};

// vLLM's top-p over a kept set given as (index, weight) pairs: order tokens by
// ascending (logit, id); drop those whose ascending cumulative probability is <= 1 - p
// (keeping the largest). Equivalently, keep tokens in descending (logit, id) order
// while the mass strictly above them is < p. Only the head of the descending order
// is ever needed, so it is found by progressively wider nth_element + sort.
void apply_top_p(const float* x, std::vector<int64_t>& idx, std::vector<float>& wt, double total, float top_p) {
  const size_t n = idx.size();
  if (n <= 1 || top_p >= 1.0f) return;
  std::vector<size_t> pos(n);
  std::iota(pos.begin(), pos.end(), 0);
  auto before = [&](size_t a, size_t b) {  // descending (logit, id)
    return x[idx[a]] > x[idx[b]] || (x[idx[a]] == x[idx[b]] && idx[a] > idx[b]);
  };
  const double target = static_cast<double>(top_p) * total;
  size_t head = std::min<size_t>(n, 256);
  size_t keep = n;
  while (true) {
    if (head < n) std::nth_element(pos.begin(), pos.begin() + head, pos.end(), before);
    std::sort(pos.begin(), pos.begin() + head, before);
    double above = 0.0;
    size_t r = 0;
    for (; r < head; ++r) {
      if (above >= target) break;
      above += wt[pos[r]];
    }
    if (above >= target || head == n) {
      keep = r;
      break;
    }
    head = std::min(n, head * 4);
  }
  std::vector<char> kept(n, 0);
  for (size_t r = 0; r < keep; ++r) kept[pos[r]] = 1;
  size_t out = 0;
  for (size_t i = 0; i < n; ++i)
    if (kept[i]) {
      idx[out] = idx[i];
      wt[out] = wt[i];
      ++out;
    }
  idx.resize(out);
  wt.resize(out);
}

#if defined(__AVX2__)
// For each 8-bit mask, the lanes it selects, first: a permutation that packs them.
const int32_t* pack_table() {
  static const std::vector<int32_t> table = [] {
    std::vector<int32_t> t(256 * 8, 0);
    for (int mask = 0; mask < 256; ++mask) {
      int out = 0;
      for (int lane = 0; lane < 8; ++lane)
        if (mask >> lane & 1) t[mask * 8 + out++] = lane;
    }
    return t;
  }();
  return table.data();
}

// Stores the lanes of a and b that `mask` selects, packed first, at a_out and b_out (all eight
// lanes are written: the caller leaves room past the end) and returns how many. Lanes are moved
// as bits, so b may hold int32 ids.
inline int pack_lanes(const int32_t* pack, int mask, __m256 a, __m256 b, float* a_out, float* b_out) {
  const __m256i perm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pack + mask * 8));
  _mm256_storeu_ps(a_out, _mm256_permutevar8x32_ps(a, perm));
  _mm256_storeu_ps(b_out, _mm256_permutevar8x32_ps(b, perm));
  return __builtin_popcount(mask);
}
#endif

// Writes the candidates among x[0, n) (weight > 0, lo < x <= hi) to the front of ox, their
// weights to ow and their ids (first_id + position) to oi (each of size >= n + 8); returns
// their count. With AVX2, eight lanes at a time: the compare mask picks a permutation that
// packs the selected lanes first; 32 tokens without a candidate cost one test.
__attribute__((noinline)) int64_t compact_row(const float* x, int64_t n, float lo, float hi, float m, float inv_t,
                                              float min_p_cut, float* ox, float* ow, int32_t* oi,
                                              int64_t first_id = 0) {
  int64_t k = 0, j = 0;
#if defined(__AVX2__)
  const int32_t* pack = pack_table();
  const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), vm = _mm256_set1_ps(m);
  const __m256 vinv = _mm256_set1_ps(inv_t), vcut = _mm256_set1_ps(min_p_cut), vfloor = _mm256_set1_ps(-87.0f);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  auto within = [&](__m256 xv) {
    return _mm256_and_ps(_mm256_cmp_ps(xv, vlo, _CMP_GT_OQ), _mm256_cmp_ps(xv, vhi, _CMP_LE_OQ));
  };
  auto pack8 = [&](int64_t at) {
    const __m256 xv = _mm256_loadu_ps(x + at);
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(xv, vm), vinv);  // as weight_of
    const __m256 weighs = _mm256_and_ps(_mm256_cmp_ps(xv, vcut, _CMP_GE_OQ), _mm256_cmp_ps(z, vfloor, _CMP_GT_OQ));
    const int mask = _mm256_movemask_ps(_mm256_and_ps(weighs, within(xv)));  // no branch on it: unpredictable
    const __m256i ids = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first_id + at)), lanes);
    k += pack_lanes(pack, mask, xv, _mm256_castsi256_ps(ids), ox + k, reinterpret_cast<float*>(oi + k));
  };
  // A group of 32 with no token in (lo, hi] is skipped on one test: in a narrow bracket most are.
  for (; j + 32 <= n; j += 32) {
    const __m256 any = _mm256_or_ps(_mm256_or_ps(within(_mm256_loadu_ps(x + j)), within(_mm256_loadu_ps(x + j + 8))),
                                    _mm256_or_ps(within(_mm256_loadu_ps(x + j + 16)), within(_mm256_loadu_ps(x + j + 24))));
    if (_mm256_testz_ps(any, any)) continue;  // sign bits: the compare masks are all ones or zeros
    pack8(j), pack8(j + 8), pack8(j + 16), pack8(j + 24);
  }
  for (; j + 8 <= n; j += 8) pack8(j);
#endif
  for (; j < n; ++j) {
    const float xj = x[j];
    const float z = (xj - m) * inv_t;
    ox[k] = xj;
    oi[k] = static_cast<int32_t>(first_id + j);
    k += (xj >= min_p_cut) & (z > -87.0f) & (xj > lo) & (xj <= hi);
  }
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) ow[i] = weight_of(ox[i], m, inv_t, min_p_cut);
  return k;
}

// Writes the (x, w) pairs of the candidates (w > 0, lo < x <= hi) to the front of ox/ow
// (each of size >= n + 8) and returns their count; as compact_row.
int64_t compact_candidates(const float* px, const float* pw, int64_t n, float lo, float hi, float* ox, float* ow) {
  int64_t k = 0, j = 0;
#if defined(__AVX2__)
  const int32_t* pack = pack_table();
  const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), zero = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 xv = _mm256_loadu_ps(px + j), wv = _mm256_loadu_ps(pw + j);
    const __m256 c = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(wv, zero, _CMP_GT_OQ), _mm256_cmp_ps(xv, vlo, _CMP_GT_OQ)),
                                   _mm256_cmp_ps(xv, vhi, _CMP_LE_OQ));
    k += pack_lanes(pack, _mm256_movemask_ps(c), xv, wv, ox + k, ow + k);
  }
#endif
  for (; j < n; ++j) {
    const float xj = px[j], wj = pw[j];
    ox[k] = xj;
    ow[k] = wj;
    k += (wj > 0.0f) & (xj > lo) & (xj <= hi);
  }
  return k;
}

// compact_row over the whole row into sc.cx/cw/ci[0, count), split over the threads like the
// other passes (a row alone): each range of blocks compacts into a region of its own, then the
// regions are moved together in order.
int64_t compact_row_split(const float* x, int64_t vocab, float lo, float hi, float m, float inv_t, float min_p_cut,
                          Scratch& sc) {
  constexpr int64_t REGION = BLOCK + 8;  // per block: room for the vector stores past a range's end
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  sc.cx.resize(blocks * REGION);
  sc.cw.resize(blocks * REGION);
  sc.ci.resize(blocks * REGION);
  sc.range_count.assign(blocks, -1);  // at a range's first block: its count
  over_blocks(blocks, [&](int64_t b0, int64_t b1) {
    const int64_t begin = b0 * BLOCK, end = std::min(vocab, b1 * BLOCK);
    sc.range_count[b0] = compact_row(x + begin, end - begin, lo, hi, m, inv_t, min_p_cut, sc.cx.data() + b0 * REGION,
                                     sc.cw.data() + b0 * REGION, sc.ci.data() + b0 * REGION, begin);
  });
  int64_t n = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t count = sc.range_count[b];
    if (count < 0) continue;
    if (b * REGION != n) {  // forward only: n <= b * REGION
      std::memmove(sc.cx.data() + n, sc.cx.data() + b * REGION, count * sizeof(float));
      std::memmove(sc.cw.data() + n, sc.cw.data() + b * REGION, count * sizeof(float));
      std::memmove(sc.ci.data() + n, sc.ci.data() + b * REGION, count * sizeof(int32_t));
    }
    n += count;
  }
  return n;
}

struct Bracket {
  float lo, hi;      // mass(x > lo) >= target > mass(x > hi)
  float cmin, cmax;  // bounds of the candidates' logits (lo < x <= hi, w > 0)
  double base;       // mass(x > hi)
};

struct Cut {
  float x_star;       // the smallest kept logit
  double above_star;  // mass(x > x*)
  int32_t ties;       // tokens at x*
};

// The search from a bracket. False if the bracket proves inconsistent with this search's own
// sums (a pivot bracket summed in another order can be, within rounding): no candidate left,
// or no progress; the caller then searches the whole row. Its first step compacts the
// bracket's candidates from the row into sc.cx/cw/ci[0, n_first), kept for the caller (x*
// lies among them); later ones compact in place in sc.dx/dw once few enough.
bool find_cut(const float* x, int64_t vocab, float m, float inv_t, float min_p_cut, double target, Bracket b,
              Scratch& sc, int64_t& n_first, Cut& cut) {
  constexpr float POS_INF = std::numeric_limits<float>::infinity();
  float lo = b.lo, hi = b.hi, cmin = b.cmin, cmax = b.cmax;
  double base = b.base;
  int64_t n = compact_row_split(x, vocab, lo, hi, m, inv_t, min_p_cut, sc);
  n_first = n;
  const float* px = sc.cx.data();
  const float* pw = sc.cw.data();
  int64_t n_cand = n;
  // Value bisection on floats, and exact jumps to ml/mb: far fewer steps than this.
  for (int step = 0; step < 512; ++step) {
    if (!(cmin <= cmax)) return false;
    if (n_cand * 4 <= n) {
      // Candidates are a small part of the array: compact them in place (the packing never
      // writes past what it has read), first out of cx/cw, which the caller still needs.
      if (px == sc.cx.data()) {
        sc.dx.resize(n + 8);
        sc.dw.resize(n + 8);
      }
      n = compact_candidates(px, pw, n, lo, hi, sc.dx.data(), sc.dw.data());
      px = sc.dx.data();
      pw = sc.dw.data();
      n_cand = n;
    }
    // Pivot θ with cmin <= θ < cmax splits the candidates (bisection on the logit value);
    // θ = lo when one value is left (x* is that value, and the check below ends the search).
    float theta = lo;
    if (cmin != cmax) {
      theta = cmin * 0.5f + cmax * 0.5f;
      if (!(theta < cmax) || !(theta >= cmin)) theta = cmin;
    }
    // One pass: mass above θ, the smallest logit above θ, the largest at or below it, and
    // the count above. Values loaded once, float sums per block and select-then-min/max:
    // GCC vectorises this form (a double or conditional reduction ran ~15x slower).
    double a = base;
    float ml = POS_INF, mb = NEG_INF, wl = POS_INF;  // wl: the weight at ml (w grows with x)
    int32_t n_above = 0;
    for (int64_t begin = 0; begin < n; begin += BLOCK) {
      const int64_t end = std::min(n, begin + BLOCK);
      float s = 0.0f;
#pragma omp simd reduction(+ : s, n_above) reduction(min : ml, wl) reduction(max : mb)
      for (int64_t j = begin; j < end; ++j) {
        const float xj = px[j], wj = pw[j];
        const bool c = (wj > 0.0f) & (xj > lo) & (xj <= hi);
        const bool up = c & (xj > theta);
        s += up ? wj : 0.0f;
        ml = std::min(ml, up ? xj : POS_INF);
        wl = std::min(wl, up ? wj : POS_INF);
        mb = std::max(mb, (c & !up) ? xj : NEG_INF);
        n_above += up ? 1 : 0;
      }
      a += s;
    }
    // Every candidate is above θ = lo: their mass is all there is, so the smallest of them is
    // the cut even if rounding left a a hair below the target.
    const bool all_in = !(theta > lo);
    if (a >= target || all_in) {
      if (n_above == 0) return false;
      // Done if the smallest logit above θ is the cut: the mass above it is < target. Its
      // tokens weigh wl each and are at most n_above: when even that bound leaves the mass
      // above them >= target, no counting pass is needed. (Were the float exp not monotone,
      // a bound too small would only postpone the end to a later step: never a wrong cut.)
      double m_mass = static_cast<double>(wl) * n_above;
      int32_t m_count = n_above;
      if (n_above > 1 && (a - m_mass < target || all_in)) {
        m_mass = 0.0;
        m_count = 0;
        for (int64_t begin = 0; begin < n; begin += BLOCK) {
          const int64_t end = std::min(n, begin + BLOCK);
          float s = 0.0f;
#pragma omp simd reduction(+ : s, m_count)
          for (int64_t j = begin; j < end; ++j) {
            const float xj = px[j], wj = pw[j];
            const bool at = (wj > 0.0f) & (xj == ml);
            s += at ? wj : 0.0f;
            m_count += at ? 1 : 0;
          }
          m_mass += s;
        }
      }
      if (a - m_mass < target || all_in) {
        cut = {ml, a - m_mass, m_count};
        return true;
      }
      lo = theta;
      cmin = ml;
      n_cand = n_above;
    } else {
      base = a;
      hi = theta;
      cmax = mb;
      n_cand -= n_above;
    }
  }
  return false;
}

// The kept tokens and their weights: weight_of(x_j) > 0 and (x_j > x_star, or x_j == x_star
// and j >= id_cut).
struct Keep {
  float m, inv_t, min_p_cut;
  float x_star = NEG_INF;
  int64_t id_cut = 0;
  float operator()(const float* x, int64_t j) const {  // the weight, 0 if not kept
    const bool kept = x[j] > x_star || (x[j] == x_star && j >= id_cut);
    return kept ? weight_of(x[j], m, inv_t, min_p_cut) : 0.0f;
  }
};

// vLLM's top-p over the dense weights without sorting: find the cut (x*, id*) such
// that the kept set {x > x*} ∪ {x == x*, id >= id*} is exactly the descending (logit, id)
// prefix whose mass strictly above each member is < p * total. x* is the largest logit
// value with mass(x >= x*) >= p * total, found by a pivot search with exact termination
// (as vLLM's pivot-based GPU top-k/top-p): at a pivot θ with A = mass(x > θ) >= target,
// the smallest logit above θ is x* when A minus that logit's own mass is < target. Each
// step is one vectorised pass (masked sum, min, max, count) over the current candidates,
// which are compacted once few enough; it starts from the bracket of the caller's pivot
// sums. The kept mass per block is then each block's mass above the bracket (sc.block_base,
// from the pivot sums) plus its kept candidates: no further pass over the row. Sets `keep`'s
// cut and block_sum; returns the kept mass.
double apply_top_p_dense(const float* x, int64_t vocab, std::vector<double>& block_sum, double total, float top_p,
                         Bracket start, float lowest, Scratch& sc, Keep& keep) {
  const double target = static_cast<double>(top_p) * total;
  Cut cut{NEG_INF, 0.0, 0};
  int64_t n_first = 0;
  const Bracket whole{NEG_INF, std::numeric_limits<float>::infinity(), lowest, keep.m, 0.0};
  if (!find_cut(x, vocab, keep.m, keep.inv_t, keep.min_p_cut, target, start, sc, n_first, cut)) {
    std::fill(sc.block_base.begin(), sc.block_base.end(), 0.0);  // nothing lies above hi = +inf
    if (!find_cut(x, vocab, keep.m, keep.inv_t, keep.min_p_cut, target, whole, sc, n_first, cut))
      return total;  // keep everything: neither search was consistent (never seen)
  }
  // Ties at x*: the larger ids sit above (vLLM's ascending sort, stable here) and are kept
  // while the mass above them is < target.
  const float x_star = cut.x_star;
  int64_t id_cut = 0;
  if (cut.ties > 1) {
    std::vector<std::pair<int32_t, float>> tied;
    for (int64_t i = 0; i < n_first; ++i)
      if (sc.cx[i] == x_star) tied.emplace_back(sc.ci[i], sc.cw[i]);
    std::sort(tied.begin(), tied.end(), std::greater<>());
    double tie_above = cut.above_star;
    for (const auto& [j, wj] : tied) {
      if (tie_above >= target) break;
      tie_above += wj;
      id_cut = j;
    }
  }
  keep.x_star = x_star;
  keep.id_cut = id_cut;
  const int64_t blocks = static_cast<int64_t>(block_sum.size());
  for (int64_t b = 0; b < blocks; ++b) block_sum[b] = sc.block_base[b];
  for (int64_t i = 0; i < n_first; ++i) {
    const float xi = sc.cx[i];
    const int32_t j = sc.ci[i];
    if (xi > x_star || (xi == x_star && j >= id_cut)) block_sum[j / BLOCK] += sc.cw[i];
  }
  double kept = 0.0;
  for (int64_t b = 0; b < blocks; ++b) kept += block_sum[b];
  return kept;
}

RowResult walk(const std::vector<int64_t>& idx, const std::vector<float>& wt, double u, bool sorted_order) {
  double total = 0.0;
  for (float v : wt) total += v;
  std::vector<size_t> order(idx.size());
  std::iota(order.begin(), order.end(), 0);
  if (sorted_order)
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return wt[a] > wt[b] || (wt[a] == wt[b] && idx[a] < idx[b]); });
  const double target = u * total;
  double acc = 0.0;
  for (size_t i : order) {
    if (acc + wt[i] > target) return {idx[i], acc / total, wt[i] / total};
    acc += wt[i];
  }
  const size_t last = order.back();
  return {idx[last], (total - wt[last]) / total, wt[last] / total};
}

// The k largest values of x[begin, end) into `heap` (a min-heap: front() is the smallest of
// them; fewer if the range is shorter): one comparison per token once it is full.
void largest_k(const float* x, int64_t begin, int64_t end, int64_t k, std::vector<float>& heap) {
  heap.clear();
  heap.reserve(k);
  constexpr int64_t CHUNK = 16;
  for (int64_t lo = begin; lo < end; lo += CHUNK) {
    const int64_t hi = std::min(end, lo + CHUNK);
    if (static_cast<int64_t>(heap.size()) == k) {
      // Once the heap is full most chunks cannot enter it: skip them on a vectorised max.
      float chunk_max = NEG_INF;
#pragma omp simd reduction(max : chunk_max)
      for (int64_t j = lo; j < hi; ++j) chunk_max = x[j] > chunk_max ? x[j] : chunk_max;
      if (!(chunk_max > heap.front())) continue;
    }
    for (int64_t j = lo; j < hi; ++j) {
      if (static_cast<int64_t>(heap.size()) < k) {
        heap.push_back(x[j]);
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      } else if (x[j] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
        heap.back() = x[j];
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      }
    }
  }
}

// Top-k up to HEAP_K: the k-th largest value from size-k min-heaps, one per range of blocks (a
// row alone is split over the threads).
constexpr int64_t HEAP_K = 128;

float kth_largest_by_heaps(const float* x, int64_t vocab, int64_t k, Scratch& sc) {
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  sc.heaps.resize(blocks);
  sc.range_count.assign(blocks, -1);  // at a range's first block: 1
  over_blocks(blocks, [&](int64_t b0, int64_t b1) {
    largest_k(x, b0 * BLOCK, std::min(vocab, b1 * BLOCK), k, sc.heaps[b0]);
    sc.range_count[b0] = 1;
  });
  std::vector<float>& all = sc.heaps[0];  // the first range's heap, then every other's
  for (int64_t b = 1; b < blocks; ++b)
    if (sc.range_count[b] > 0) all.insert(all.end(), sc.heaps[b].begin(), sc.heaps[b].end());
  // The k largest of the row are among the ranges' k largest: the k-th of those is the row's.
  std::nth_element(all.begin(), all.begin() + (k - 1), all.end(), std::greater<float>());
  return all[k - 1];
}

// Top-k above HEAP_K: the k-th largest value by selection instead of heaps (a heap's cost grows
// with k·log k): tokens counted above the pivots bracket it, the bracket's tokens are compacted,
// and nth_element picks it among them. -inf when fewer than k tokens are finite.
float kth_largest_by_selection(const float* x, int64_t vocab, int64_t k, float m, const float* theta, Scratch& sc) {
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  sc.pivot_count.resize(blocks * PIVOTS);
  over_blocks(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * BLOCK, len = std::min(vocab, lo + BLOCK) - lo;
      for (int i = 0; i < PIVOTS; i += 4) block_pivot_counts(x + lo, len, theta + i, sc.pivot_count.data() + b * PIVOTS + i);
    }
  });
  // The k-th largest v: count(x > t) >= k means v > t; count(x > t) < k means v <= t.
  float lo = NEG_INF, hi = std::numeric_limits<float>::infinity();
  int64_t above_hi = 0;
  for (int i = 0; i < PIVOTS; ++i) {  // theta decreasing, counts increasing
    int64_t count = 0;
    for (int64_t b = 0; b < blocks; ++b) count += sc.pivot_count[b * PIVOTS + i];
    if (count >= k) {
      lo = theta[i];
      break;
    }
    hi = theta[i];
    above_hi = count;
  }
  // The bracket's finite tokens (no weight condition: inv_t 0 and no min-p cut keep them all).
  const int64_t n = compact_row_split(x, vocab, lo, hi, m, 0.0f, -std::numeric_limits<float>::max(), sc);
  const int64_t rank = k - above_hi;  // v is the rank-th largest in the bracket
  if (rank > n) return NEG_INF;       // only with lo = -inf: fewer than k finite tokens
  std::nth_element(sc.cx.begin(), sc.cx.begin() + (rank - 1), sc.cx.begin() + n, std::greater<float>());
  return sc.cx[rank - 1];
}

RowResult sample_row(const float* x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                     double u, bool sorted_order, Scratch& sc) {
  const float inv_t = 1.0f / temperature;
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  sc.block_max.resize(blocks);
  sc.block_min.resize(blocks);
  sc.block_nans.resize(blocks);
  over_blocks(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      block_extremes(x, b * BLOCK, std::min(vocab, (b + 1) * BLOCK), sc.block_max[b], sc.block_min[b],
                     sc.block_nans[b]);
  });
  float m = NEG_INF, x_min = std::numeric_limits<float>::infinity();
  int64_t nans = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    m = std::max(m, sc.block_max[b]);
    x_min = std::min(x_min, sc.block_min[b]);
    nans += sc.block_nans[b];
  }
  if (nans || !(m > NEG_INF)) return {-1, 0.0, 0.0};  // caller raises
  const float min_p_cut = min_p > 0.0f ? m + temperature * std::log(min_p) : -std::numeric_limits<float>::max();
  std::vector<int64_t>& idx = sc.idx;
  std::vector<float>& wt = sc.wt;

  float theta[PIVOTS];  // top-p's pivots (and top-k's above HEAP_K)
  for (int i = 0; i < PIVOTS; ++i) theta[i] = m + temperature * PIVOT_Z[i];
  if (top_k > 0 && top_k < vocab) {
    // Sparse path: the k-th largest logit, then every token at or above it (vLLM keeps ties),
    // compacted in token-id order.
    const float kth = top_k > HEAP_K ? kth_largest_by_selection(x, vocab, top_k, m, theta, sc)
                                     : kth_largest_by_heaps(x, vocab, top_k, sc);
    const float cut = std::max(kth, min_p_cut);
    const int64_t n = compact_row_split(x, vocab, std::nextafter(cut, NEG_INF), std::numeric_limits<float>::infinity(),
                                        m, inv_t, min_p_cut, sc);
    idx.resize(n);
    wt.resize(n);
    for (int64_t i = 0; i < n; ++i) idx[i] = sc.ci[i], wt[i] = sc.cw[i];
    double total = 0.0;
    for (float v : wt) total += v;
    apply_top_p(x, idx, wt, total, top_p);
    return walk(idx, wt, u, sorted_order);
  }

  // Dense path: the weights summed per block (each block's weights in a buffer in L1, not
  // stored: the row is read again where needed, not a second array); with top-p, also the
  // mass and count above each pivot, per block.
  const bool pivots = top_p < 1.0f;
  Keep keep{m, inv_t, min_p_cut};  // every token of positive weight, unless top-p cuts
  std::vector<double>& block_sum = sc.block_sum;
  block_sum.assign(blocks, 0.0);
  if (pivots) sc.pivot_mass.assign(blocks * PIVOTS, 0.0f);
  over_blocks(blocks, [&](int64_t b0, int64_t b1) {
    alignas(64) float wb[BLOCK];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * BLOCK, len = std::min(vocab, lo + BLOCK) - lo;
      block_sum[b] = block_weights(x + lo, wb, 0, len, m, inv_t, min_p_cut);
      // A second pass over the block while it is in L1: the masked sums vectorise there,
      // where one loop with the exponential and eight more reductions did not.
      if (pivots)
        for (int i = 0; i < PIVOTS; i += 4) block_pivot_sums(x + lo, wb, len, theta + i, sc.pivot_mass.data() + b * PIVOTS + i);
    }
  });
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) total += block_sum[b];
  if (pivots) {
    // Tokens of positive weight lie above all three bounds (z > -87: see exp_nonpositive).
    const float lowest = std::max({x_min, min_p_cut, m - 87.0f * temperature});
    double mass[PIVOTS] = {};
    for (int64_t b = 0; b < blocks; ++b)
      for (int i = 0; i < PIVOTS; ++i) mass[i] += sc.pivot_mass[b * PIVOTS + i];
    // The bracket: lo the highest pivot with mass above it >= target, hi the lowest with less.
    const double target = static_cast<double>(top_p) * total;
    Bracket start{NEG_INF, std::numeric_limits<float>::infinity(), lowest, m, 0.0};
    int hi_pivot = -1;
    for (int i = 0; i < PIVOTS; ++i) {  // theta decreasing, mass increasing
      if (mass[i] < target) {
        start.hi = theta[i];
        start.cmax = std::min(m, theta[i]);
        start.base = mass[i];
        hi_pivot = i;
      } else {
        start.lo = theta[i];
        start.cmin = std::max(lowest, theta[i]);
        break;
      }
    }
    sc.block_base.resize(blocks);
    for (int64_t b = 0; b < blocks; ++b)
      sc.block_base[b] = hi_pivot < 0 ? 0.0 : static_cast<double>(sc.pivot_mass[b * PIVOTS + hi_pivot]);
    total = apply_top_p_dense(x, vocab, block_sum, total, top_p, start, lowest, sc, keep);
  }
  if (sorted_order) {
    idx.clear();
    wt.clear();
    for (int64_t j = 0; j < vocab; ++j)
      if (const float wj = keep(x, j); wj > 0.0f) {
        idx.push_back(j);
        wt.push_back(wj);
      }
    return walk(idx, wt, u, true);
  }
  // Token-id order over the dense row: skip whole blocks by their sums.
  const double target = u * total;
  double acc = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (block_sum[b] > 0.0 && acc + block_sum[b] > target) {
      const int64_t lo = b * BLOCK, hi = std::min(vocab, lo + BLOCK);
      for (int64_t j = lo; j < hi; ++j) {
        const float wj = keep(x, j);
        if (!(wj > 0.0f)) continue;
        if (acc + wj > target) return {j, acc / total, wj / total};
        acc += wj;
      }
      continue;  // rounding left the target past this block's partial sums
    }
    acc += block_sum[b];
  }
  for (int64_t j = vocab - 1; j >= 0; --j)  // u within rounding of 1: the last kept token
    if (const float wj = keep(x, j); wj > 0.0f) return {j, (total - wj) / total, wj / total};
  return {-1, 0.0, 0.0};
}

}  // namespace

std::vector<torch::Tensor> fused_inverse_cdf(const torch::Tensor& logits, const torch::Tensor& temperature,
                                             const torch::Tensor& top_k, const torch::Tensor& top_p,
                                             const torch::Tensor& min_p, const torch::Tensor& uniforms,
                                             bool sorted_order) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2, "logits must be a [batch, vocab] CPU tensor");
  auto x = logits.to(torch::kFloat32).contiguous();
  auto t = temperature.to(torch::kFloat32).contiguous();
  auto k = top_k.to(torch::kInt64).contiguous();
  auto p = top_p.to(torch::kFloat32).contiguous();
  auto mp = min_p.to(torch::kFloat32).contiguous();
  auto uu = uniforms.to(torch::kFloat64).contiguous();
  const int64_t batch = x.size(0), vocab = x.size(1);
  auto tokens = torch::empty({batch}, torch::kInt64);
  auto starts = torch::empty({batch}, torch::kFloat64);
  auto probs = torch::empty({batch}, torch::kFloat64);
  const float* xp = x.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const float* pp = p.data_ptr<float>();
  const float* mpp = mp.data_ptr<float>();
  const double* up = uu.data_ptr<double>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  double* st = starts.data_ptr<double>();
  double* pr = probs.data_ptr<double>();
  auto rows = [&](int64_t begin, int64_t end) {
    // Kept by each thread across calls: sized for the vocabulary once, not zero-filled per call.
    thread_local Scratch scratch;
    for (int64_t r = begin; r < end; ++r) {
      const RowResult res = sample_row(xp + r * vocab, vocab, tp[r], kp[r], pp[r], mpp[r], up[r], sorted_order, scratch);
      tok[r] = res.token;
      st[r] = res.start;
      pr[r] = res.prob;
    }
  };
  // Fewer rows than threads: one row after another, each split over the threads (over_blocks);
  // otherwise one row per task.
  if (batch < at::get_num_threads())
    rows(0, batch);
  else
    at::parallel_for(0, batch, 1, rows);
  return {tokens, starts, probs};
}

#ifndef QMC_BUILT_WITH_TORCH
#define QMC_BUILT_WITH_TORCH "unknown"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_inverse_cdf", &fused_inverse_cdf,
        "temperature/min-p/top-k/top-p + inverse CDF per row (CPU); returns [tokens, starts, probs]");
  // torch's C++ ABI changes between releases: the loader uses the kernel only under this torch.
  m.attr("built_with_torch") = QMC_BUILT_WITH_TORCH;
}
