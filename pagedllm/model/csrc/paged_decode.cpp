// Paged attention for decode steps (one query token per sequence), reading K/V in place through block tables.
// The portable torch path must first gather every sequence's blocks into a padded tensor, which copies the whole
// context each step and layer; this kernel reads each cached key and value exactly once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

template <typename T>
static void decode_kernel(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                          const int64_t* seq_lens, float* out, int64_t S, int64_t H, int64_t KVH, int64_t D,
                          int64_t BS, int64_t MB, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    std::vector<float> kv(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / KVH, h = item % KVH;
      const int64_t L = seq_lens[s];
      const int64_t* table = block_tables + s * MB;
      const float* qs = q + (s * H + h * G) * D;  // the G query heads that share KV head h
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* kp = k_cache + ((table[t / BS] * BS + t % BS) * KVH + h) * D;
        for (int64_t d = 0; d < D; ++d) kv[d] = static_cast<float>(kp[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * kv[d];
          scores[g * L + t] = dot * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float mx = -INFINITY;
        for (int64_t t = 0; t < L; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* vp = v_cache + ((table[t / BS] * BS + t % BS) * KVH + h) * D;
        for (int64_t d = 0; d < D; ++d) kv[d] = static_cast<float>(vp[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * kv[d];
        }
      }
      float* o = out + (s * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) o[i] = acc[i];
    }
  });
}

// q: [S, H, D] (any float dtype); caches: [blocks, block_size, KVH, D]; block_tables: [S, MB] int64;
// seq_lens: [S] int64 (tokens each query attends to, itself included). Returns [S, H, D] in q's dtype.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale) {
  auto qf = q.to(torch::kFloat32).contiguous();
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto sl = seq_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV caches must be contiguous");
  const int64_t S = qf.size(0), H = qf.size(1), D = qf.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = bt.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "shape mismatch");
  auto out = torch::empty({S, H, D}, qf.options());
  if (k_cache.scalar_type() == torch::kFloat32) {
    decode_kernel<float>(qf.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), out.data_ptr<float>(), S, H, KVH, D, BS, MB,
                         static_cast<float>(scale));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16, "KV cache must be float32 or bfloat16");
    decode_kernel<at::BFloat16>(qf.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(),
                                v_cache.data_ptr<at::BFloat16>(), bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(),
                                out.data_ptr<float>(), S, H, KVH, D, BS, MB, static_cast<float>(scale));
  }
  return out.to(q.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged attention for one query token per sequence");
}
