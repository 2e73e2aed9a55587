// decode_attention: one new token's attention over all its keys.

#include <numeric>
#include <string>

#include "common.h"

namespace torchgemma::TG_ISA {

// ── Attention of one new token ───────────────────────────────────────────────────────────────
//
// A decode step's attention: one query per head against S keys, every key seen (no mask), keys
// and values shared by groups of H / Hkv query heads (a prompt's queries on the CPU attend the same
// way, each as its own row over the keys it sees: decode_attention_cpu below). softmax(scale * q
// k^T) v in float32, each group of heads reading its keys and values once, on one thread per (row, KV head, piece of keys):
// for one token the work is small, and threads share it only where a lone piece has many keys (a
// sliding layer's whole window: kSplitKeys). Exponentials by a polynomial good to ~1 ulp (exp_ieee,
// common.h), so the result is the exact softmax's to a float32 rounding, not sdpa's bits.

#ifdef TG_AVX2
// The sums of eight vectors' lanes, as the lanes of one.
inline __m256 hsum8(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// Keys per piece of work. A long context is split into pieces of this many keys (the keys a row
// sees, counted in order), each attended on its own (its own largest score, sum and weighted values)
// and the pieces then combined in order: the threads share one row's keys, and the result depends
// on the keys alone, not on the thread count. A row with at most this many keys is one piece, whose
// arithmetic is the unsplit softmax's.
constexpr int64_t kPiece = 1024;

// A lone piece of at least this many keys shares its work over the threads (attend_rows).
constexpr int64_t kSplitKeys = 256;

// Keys and values are read with software prefetch: the next key pair's cache lines while a pair's
// scores are summed, and each column block (16 values; 64 in the AVX-512 set) of the key kValuesAhead
// keys on while the weighted values are. The hardware's prefetch served these reads at ~6 GB/s (one
// 1 KB key or value row in two streams, or one line per row at a 1 KB stride), against ~20 for a
// plain read of the same bytes.
// 20 layers' caches read once each (4 heads, 1 KV head, D 256, Zen 4, one thread, medians of 7
// interleaved passes): 512 keys 181 -> 137 us, 4096 keys 1434 -> 1142 us (two threads: 134 -> 103,
// 697 -> 575); 8 and 32 keys ahead for the values, two and four pairs for the keys measured within
// a few percent.
constexpr int64_t kValuesAhead = 16;

// One piece: the G query heads of one KV head against `count` keys (key i at keys + at(i) * kstride,
// values likewise). Writes each head's largest score (top), sum of exponentials (sum) and the values
// weighted by them, not yet divided (acc, G x D). `probs` is scratch of at least G * count floats.
template <typename At>
void attend_piece(const float* queries, const float* keys, int64_t kstride, const float* values, int64_t vstride,
                  At at, int64_t count, int64_t G, int64_t D, float scale, float* probs, float* top_out,
                  float* sum_out, float* acc, bool split) {
  const int64_t S = count;
  // Scores: every key read once for the group's heads.
  int64_t j0 = 0;
#ifdef TG_AVX2
  if (G % 4 == 0 && D % 8 == 0) {
    // Two keys x four heads at a time: eight independent chains, summed together at the end.
    const auto pairs = [&](int64_t p0, int64_t p1) {
      for (int64_t j = 2 * p0; j < 2 * p1; j += 2) {
        const float* key0 = keys + at(j) * kstride;
        const float* key1 = keys + at(j + 1) * kstride;
        const float* ahead0 = keys + at(std::min(j + 2, S - 1)) * kstride;  // the next pair, fetched ahead
        const float* ahead1 = keys + at(std::min(j + 3, S - 1)) * kstride;
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          __m256 a[8];
          for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8) {
            if (g0 == 0 && d % 16 == 0) {
              _mm_prefetch(reinterpret_cast<const char*>(ahead0 + d), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(ahead1 + d), _MM_HINT_T0);
            }
            const __m256 a0 = _mm256_loadu_ps(key0 + d), a1 = _mm256_loadu_ps(key1 + d);
            for (int i = 0; i < 4; ++i) {
              const __m256 qv = _mm256_loadu_ps(queries + (g0 + i) * D + d);
              a[i] = _mm256_fmadd_ps(qv, a0, a[i]);
              a[4 + i] = _mm256_fmadd_ps(qv, a1, a[4 + i]);
            }
          }
          alignas(32) float dots[8];
          _mm256_store_ps(dots, hsum8(a));
          for (int i = 0; i < 4; ++i) {
            probs[(g0 + i) * S + j] = dots[i] * scale;
            probs[(g0 + i) * S + j + 1] = dots[4 + i] * scale;
          }
        }
      }
    };
    if (split) at::parallel_for(0, S / 2, 64, pairs);
    else pairs(0, S / 2);
    j0 = S / 2 * 2;
    if (j0 < S) {
      // The last of an odd number of keys: the pairs' arithmetic for one key (each score is its own
      // chain of FMAs and its own sum of lanes), so a key's score does not depend on where it falls.
      // (A scalar loop here cost ~1 us per query: half of a 125-token prompt's queries have one.)
      const float* key = keys + at(j0) * kstride;
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 a0 = _mm256_loadu_ps(key + d);
          for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(queries + (g0 + i) * D + d), a0, a[i]);
        }
        alignas(32) float dots[8];
        _mm256_store_ps(dots, hsum8(a));
        for (int i = 0; i < 4; ++i) probs[(g0 + i) * S + j0] = dots[i] * scale;
      }
      j0 = S;
    }
  }
#endif
  for (int64_t j = j0; j < S; ++j) {
    const float* key = keys + at(j) * kstride;
    for (int64_t g = 0; g < G; ++g) {
      const float* query = queries + g * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += query[d] * key[d];
      probs[g * S + j] = dot * scale;
    }
  }
  // Softmax of each head's scores (the division left for the end).
  for (int64_t g = 0; g < G; ++g) {
    float* p = probs + g * S;
    int64_t j = 0;
    float top = -std::numeric_limits<float>::infinity();
#ifdef TG_AVX2
    if (S >= 8) {
      __m256 most = _mm256_loadu_ps(p);
      for (j = 8; j + 8 <= S; j += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(p + j));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, most);
      top = *std::max_element(lanes, lanes + 8);
    }
#endif
    for (; j < S; ++j) top = std::max(top, p[j]);
    j = 0;
    float sum = 0.f;
#ifdef TG_AVX2
    __m256 total = _mm256_setzero_ps();
    for (; j + 8 <= S; j += 8) {
      const __m256 e = exp_ieee(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(top)));
      _mm256_storeu_ps(p + j, e);
      total = _mm256_add_ps(total, e);
    }
    sum = hsum(total);
#endif
    for (; j < S; ++j) {
      p[j] = exp_ieee(p[j] - top);  // (the vectors' bits: a value's weight does not depend on where it falls)
      sum += p[j];
    }
    top_out[g] = top;
    sum_out[g] = sum;
  }
  // Weighted values: every value read once for the group's heads.
  std::fill(acc, acc + G * D, 0.f);
  int64_t d0 = 0;
#ifdef TG_AVX512
  if (G % 4 == 0 && D % 64 == 0) {
    // Sixty-four values of four heads held in registers (16 of the 32) across all keys: each key's
    // values read 256 bytes at a time, in D / 64 passes over the keys rather than D / 16. Each value
    // is the AVX2 code's chain of FMAs below, key after key: the same bits. 20 layers' caches read
    // once each (4 heads, 1 KV head, D 256, Zen 4, medians of 9 passes interleaved with the AVX2 set,
    // the same bits): 300 / 512 / 4096 keys 97 -> 84, 178 -> 153, 1386 -> 1171 us at one thread;
    // 26 -> 19, 83 -> 72, 652 -> 609 us at two.
    const auto columns = [&](int64_t c0, int64_t c1) {
      for (int64_t d = 64 * c0; d < 64 * c1; d += 64) {
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          __m512 a[4][4];
          for (int i = 0; i < 4; ++i)
            for (int l = 0; l < 4; ++l) a[i][l] = _mm512_setzero_ps();
          for (int64_t j = 0; j < S; ++j) {
            if (j + kValuesAhead < S) {
              const float* ahead = values + at(j + kValuesAhead) * vstride + d;
              for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * l), _MM_HINT_T0);
            }
            const float* value = values + at(j) * vstride + d;
            __m512 v[4];
            for (int l = 0; l < 4; ++l) v[l] = _mm512_loadu_ps(value + 16 * l);
            for (int i = 0; i < 4; ++i) {
              const __m512 w = _mm512_set1_ps(probs[(g0 + i) * S + j]);
              for (int l = 0; l < 4; ++l) a[i][l] = _mm512_fmadd_ps(w, v[l], a[i][l]);
            }
          }
          for (int i = 0; i < 4; ++i)
            for (int l = 0; l < 4; ++l) _mm512_storeu_ps(acc + (g0 + i) * D + d + 16 * l, a[i][l]);
        }
      }
    };
    if (split) at::parallel_for(0, D / 64, 1, columns);
    else columns(0, D / 64);
    d0 = D;
  }
#endif
#ifdef TG_AVX2
  if (d0 == 0 && G % 4 == 0) {
    // Sixteen values of four heads held in registers across all keys.
    const auto columns = [&](int64_t c0, int64_t c1) {
      for (int64_t d = 16 * c0; d < 16 * c1; d += 16) {
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          __m256 a[4][2];
          for (int i = 0; i < 4; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
          for (int64_t j = 0; j < S; ++j) {
            if (j + kValuesAhead < S)
              _mm_prefetch(reinterpret_cast<const char*>(values + at(j + kValuesAhead) * vstride + d), _MM_HINT_T0);
            const float* value = values + at(j) * vstride + d;
            const __m256 v0 = _mm256_loadu_ps(value), v1 = _mm256_loadu_ps(value + 8);
            for (int i = 0; i < 4; ++i) {
              const __m256 w = _mm256_broadcast_ss(&probs[(g0 + i) * S + j]);
              a[i][0] = _mm256_fmadd_ps(w, v0, a[i][0]);
              a[i][1] = _mm256_fmadd_ps(w, v1, a[i][1]);
            }
          }
          for (int i = 0; i < 4; ++i) {
            _mm256_storeu_ps(acc + (g0 + i) * D + d, a[i][0]);
            _mm256_storeu_ps(acc + (g0 + i) * D + d + 8, a[i][1]);
          }
        }
      }
    };
    if (split) at::parallel_for(0, D / 16, 1, columns);
    else columns(0, D / 16);
    d0 = D / 16 * 16;
  }
#endif
  for (int64_t j = 0; j < S; ++j) {
    const float* value = values + at(j) * vstride;
    for (int64_t g = 0; g < G; ++g) {
      const float w = probs[g * S + j];
      for (int64_t d = d0; d < D; ++d) acc[g * D + d] += w * value[d];
    }
  }
}

// Where each row's keys are: row r's at columns lists[r], in that order, or, where lists[r] is empty,
// at columns starts[r] .. starts[r] + counts[r] - 1 (a causal or sliding row: no list to build).
struct KeyColumns {
  std::vector<std::vector<int64_t>> lists;
  std::vector<int64_t> starts, counts;
  explicit KeyColumns(int64_t rows) : lists(rows), starts(rows, 0), counts(rows, 0) {}
};

// The attention of N rows, one query each (q (N, H, 1, D) contiguous): row r's keys and values are
// those of k and v at dim-0 index rows[r], at the columns `keys` gives. Contexts of more than kPiece
// keys are split into pieces (see kPiece).
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& rows,
                       const KeyColumns& keys_of, double scale_in) {
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), D = q.size(3), G = H / Hkv;
  const std::vector<int64_t>& counts = keys_of.counts;
  const int64_t widest = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  // The pieces of work: (row, KV head, piece), in that order.
  std::vector<int64_t> first_piece(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) first_piece[b + 1] = first_piece[b] + (counts[b] + kPiece - 1) / kPiece;
  const int64_t pieces = first_piece[B];  // per KV head
  const float scale = static_cast<float>(scale_in);
  // Each piece's largest scores, sums and weighted values (every value written before it is read),
  // in the calling thread's buffers kept from call to call up to 4 MB: a prompt's 125 queries need 512
  // KB of them, which fresh from the allocator were fresh pages each call (~30 us of 0.6 ms).
  thread_local std::vector<float> kept_tops, kept_sums, kept_accs;
  std::vector<float>&tops = kept_tops, &sums = kept_sums, &accs = kept_accs;
  tops.resize(Hkv * pieces * G);
  sums.resize(Hkv * pieces * G);
  accs.resize(Hkv * pieces * G * D);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  // One task of many keys (one row, one KV head, one piece: a sliding layer's window) with threads to
  // spare: its scores (key pairs) and its weighted values (columns of 16) are shared over the threads
  // instead, each value still computed whole by one thread (the same bits).
  const int64_t tasks = Hkv * pieces;
  const bool split = tasks == 1 && widest >= kSplitKeys && at::get_num_threads() > 1 && !at::in_parallel_region();
  const auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> probs(G * std::min(widest, kPiece));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kh = task / pieces, piece = task % pieces;
      const int64_t b = std::upper_bound(first_piece.begin(), first_piece.end(), piece) - first_piece.begin() - 1;
      const int64_t lo = (piece - first_piece[b]) * kPiece, count = std::min(kPiece, counts[b] - lo);
      const float* keys = kp + rows[b] * k.stride(0) + kh * k.stride(1);
      const float* values = vp + rows[b] * v.stride(0) + kh * v.stride(1);
      const float* queries = qp + (b * H + kh * G) * D;  // the group's G query heads, one after another
      float* top = tops.data() + task * G;
      float* sum = sums.data() + task * G;
      float* acc = accs.data() + task * G * D;
      if (!keys_of.lists[b].empty()) {
        const int64_t* cols = keys_of.lists[b].data() + lo;
        attend_piece(queries, keys, k.stride(2), values, v.stride(2), [cols](int64_t j) { return cols[j]; }, count,
                     G, D, scale, probs.data(), top, sum, acc, split);
      } else {
        const int64_t first = keys_of.starts[b] + lo;
        attend_piece(queries, keys, k.stride(2), values, v.stride(2), [first](int64_t j) { return first + j; },
                     count, G, D, scale, probs.data(), top, sum, acc, split);
      }
    }
  };
  // Tasks differ in size (a prompt's later queries see more keys): taken from a shared counter
  // (parallel_tasks), a few per thread, rather than in equal shares of rows.
  if (split) run(0, 1);
  else parallel_tasks(tasks, std::max<int64_t>(1, tasks / (8 * at::get_num_threads())), run);
  // Each (row, KV head): its pieces combined in order, then divided by the weights' sum.
  at::Tensor out = at::empty({B, 1, H, D}, q.options());
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p0 = first_piece[b], p1 = first_piece[b + 1];
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      for (int64_t g = 0; g < G; ++g) {
        float* outs = op + (b * H + kh * G + g) * D;
        const auto slot = [&](int64_t piece) { return (kh * pieces + piece) * G + g; };
        if (p1 - p0 == 1) {  // one piece: the unsplit softmax's arithmetic
          const float* acc = accs.data() + slot(p0) * D;
          for (int64_t d = 0; d < D; ++d) outs[d] = acc[d] / sums[slot(p0)];
          continue;
        }
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t p = p0; p < p1; ++p) top = std::max(top, tops[slot(p)]);
        float total = 0.f;
        std::fill(outs, outs + D, 0.f);
        for (int64_t p = p0; p < p1; ++p) {
          const float factor = std::exp(tops[slot(p)] - top);
          total += sums[slot(p)] * factor;
          const float* acc = accs.data() + slot(p) * D;
          for (int64_t d = 0; d < D; ++d) outs[d] += acc[d] * factor;
        }
        for (int64_t d = 0; d < D; ++d) outs[d] /= total;
      }
    }
  }
  if (accs.size() > (size_t{1} << 20)) accs = std::vector<float>{};  // a long context's: back to the allocator
  return out;
}

// Row r's visible marks (S bools at marks) into keys_of: an interval where they are one, else a list
// of the columns `column(j)` maps them to (always a list where `ring`: a ring's columns wrap).
// `what()` names the row in the error for a row that sees nothing (built only then).
template <typename Column, typename What>
void visible_keys(const bool* marks, int64_t S, int64_t r, Column column, bool ring, KeyColumns& keys_of,
                  const char* op, What what) {
  int64_t first = 0, end = S;
  while (first < S && !marks[first]) ++first;
  while (end > first && !marks[end - 1]) --end;
  TORCH_CHECK(first < end, op, ": ", what(), " sees no key (a softmax over none is 0 / 0)");
  if (!ring && std::all_of(marks + first, marks + end, [](bool m) { return m; })) {
    keys_of.starts[r] = first;
    keys_of.counts[r] = end - first;
    return;
  }
  std::vector<int64_t>& list = keys_of.lists[r];
  for (int64_t j = first; j < end; ++j)
    if (marks[j]) list.push_back(column(j));
  keys_of.counts[r] = static_cast<int64_t>(list.size());
}

void check_query(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool one) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, op,
              ": float32 tensors expected");
  TORCH_CHECK(q.dim() == 4 && (one ? q.size(2) == 1 : q.size(2) >= 1) && k.dim() == 4 && v.sizes() == k.sizes() &&
                  k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 && k.size(2) > 0,
              op, ": q (B, H, ", one ? "1" : "T", ", D) and k, v (*, Hkv, S, D) expected, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
}

// q (B, H, T, D), k and v (B, Hkv, S, D) (any strides but the last) -> (B, T, H, D), float32. Each of
// the T queries of a row attends on its own, as a decode step's one query would: `visible` (B, S) or
// (B, T, S) bool, optional (all keys), marks the keys each query sees (the others are skipped; every
// query must see at least one). A query gets the bits it would get from its visible keys alone, in
// column order, whatever T, the batch's other rows or the thread count: a prompt's token attends
// here as its decode step would.
at::Tensor decode_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                double scale, const std::optional<at::Tensor>& visible_in) {
  check_query("decode_attention", q_in, k_in, v_in, false);
  TORCH_CHECK(k_in.size(0) == q_in.size(0), "decode_attention: q (B, H, T, D) and k, v (B, Hkv, S, D) expected, got ",
              q_in.sizes(), ", ", k_in.sizes());
  const int64_t B = q_in.size(0), H = q_in.size(1), T = q_in.size(2), D = q_in.size(3), S = k_in.size(2);
  // The queries one row each: (B * T, H, 1, D), row b * T + t.
  const at::Tensor q = q_in.transpose(1, 2).contiguous().view({B * T, H, 1, D});
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  std::vector<int64_t> rows(B * T);
  for (int64_t r = 0; r < B * T; ++r) rows[r] = r / T;
  KeyColumns keys_of(B * T);
  if (visible_in) {
    const at::Tensor visible = visible_in->to(at::kBool).contiguous();
    const bool flat = visible.dim() == 2 && T == 1;
    TORCH_CHECK(flat || (visible.dim() == 3 && visible.size(1) == T),
                "decode_attention: visible must be (B, S) = (", B, ", ", S, ") or (B, T, S) = (", B, ", ", T, ", ", S,
                "), got ", visible.sizes());
    TORCH_CHECK(visible.size(0) == B && visible.size(-1) == S, "decode_attention: visible must be (B, S) = (", B, ", ",
                S, ") or (B, T, S) = (", B, ", ", T, ", ", S, "), got ", visible.sizes());
    const bool* marks = visible.data_ptr<bool>();
    for (int64_t r = 0; r < B * T; ++r) {
      const auto what = [r, T] {
        return T == 1 ? "row " + std::to_string(r)
                      : "row " + std::to_string(r / T) + "'s query " + std::to_string(r % T);
      };
      visible_keys(marks + r * S, S, r, [](int64_t j) { return j; }, false, keys_of, "decode_attention", what);
    }
  } else {
    std::fill(keys_of.counts.begin(), keys_of.counts.end(), S);
  }
  return attend_rows(q, k, v, rows, keys_of, scale).view({B, T, H, D});
}

// decode_attention over ring buffers, read in place: k and v (N, Hkv, R, D) hold N sequences' rings
// (column c of sequence n holds a position p with p % R == c); row b attends to sequence slots[b], its
// S logical keys j = 0..S-1 (visible (B, S)) at columns (offsets[b] + j) % R. The same bits as
// decode_attention over those keys gathered, in that order.
at::Tensor decode_attention_ring_cpu(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, double scale,
                                     const at::Tensor& visible_in, const at::Tensor& slots_in,
                                     const at::Tensor& offsets_in) {
  check_query("decode_attention_ring", q_in, k, v, true);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention_ring: rings must be contiguous in D");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), N = k.size(0), R = k.size(2), S = visible_in.size(-1);
  const at::Tensor slots = slots_in.to(at::kLong).contiguous(), offsets = offsets_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && offsets.dim() == 1 && offsets.size(0) == B,
              "decode_attention_ring: slots and offsets must be (B,) = (", B, ",), got ", slots.sizes(), " and ",
              offsets.sizes());
  TORCH_CHECK(S <= R, "decode_attention_ring: ", S, " keys per row do not fit a ring of ", R);
  std::vector<int64_t> rows(B);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= sp[b] && sp[b] < N, "decode_attention_ring: slot ", sp[b], " of row ", b, " is not in 0..", N - 1);
    rows[b] = sp[b];
  }
  const at::Tensor visible = visible_in.to(at::kBool).contiguous();
  TORCH_CHECK(visible.dim() == 2 && visible.size(0) == B, "decode_attention_ring: visible must be (B, S) = (", B,
              ", ", S, "), got ", visible.sizes());
  const bool* marks = visible.data_ptr<bool>();
  KeyColumns keys_of(B);
  for (int64_t b = 0; b < B; ++b)
    visible_keys(marks + b * S, S, b, [&](int64_t j) { return ((op[b] + j) % R + R) % R; }, true, keys_of,
                 "decode_attention_ring", [b] { return "row " + std::to_string(b); });
  return attend_rows(q, k, v, rows, keys_of, scale);
}

}  // namespace torchgemma::TG_ISA
