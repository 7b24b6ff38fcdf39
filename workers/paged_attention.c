/* Decode attention over the paged KV cache, reading every block where it lies.
 *
 * Built and loaded by workers/paged_kernel.py (the C compiler on the host, its own CPU's
 * instruction set). The torch path gathers each decode sequence's blocks into one padded
 * copy per layer and runs SDPA over it: the context is read twice and written once. Here
 * it is read once, in place, and only up to each sequence's own length.
 *
 * Cache layout (workers/llama.py PagedKVCache): data[block, layer, k|v, slot, kv_head, dim],
 * float32. One call is one layer: k_off / v_off are that layer's K / V offsets inside a
 * block, block_stride the floats per block. For each sequence s and query head h (kv head
 * h / groups, as Hugging Face's repeat_kv maps them):
 *
 *     out[s, h] = softmax(scale * K_s q[s, h]) V_s   over the ctx_lens[s] cached tokens
 *
 * Scores are taken block by block (a block's slots are one contiguous run for all heads),
 * then one softmax per head (max-subtracted, in float32), then the weighted sum of V in
 * the same block order. scores needs num_heads * max(ctx_lens) floats.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

void conveyor_paged_decode_attention(
    const float *cache, int64_t block_stride, int64_t k_off, int64_t v_off,
    int64_t block_size, int64_t num_kv_heads, int64_t groups, int64_t head_dim,
    const float *q, const int64_t *tables, int64_t table_stride, const int64_t *ctx_lens,
    int64_t num_seqs, float scale, float *out, float *scores)
{
    const int64_t nh = num_kv_heads * groups, hd = head_dim;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t ctx = ctx_lens[s];
        const int64_t *table = tables + s * table_stride;
        const float *qs = q + s * nh * hd;
        float *os = out + s * nh * hd;

        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const float *kb = cache + table[t0 / block_size] * block_stride + k_off;
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
            for (int64_t j = 0; j < n; j++) {
                for (int64_t h = 0; h < nh; h++) {
                    const float *k = kb + (j * num_kv_heads + h / groups) * hd;
                    const float *qh = qs + h * hd;
                    float dot = 0.f;
                    for (int64_t i = 0; i < hd; i++) dot += qh[i] * k[i];
                    scores[h * ctx + t0 + j] = dot * scale;
                }
            }
        }

        for (int64_t h = 0; h < nh; h++) {
            float *sc = scores + h * ctx;
            float mx = -FLT_MAX, sum = 0.f;
            for (int64_t t = 0; t < ctx; t++) mx = sc[t] > mx ? sc[t] : mx;
            for (int64_t t = 0; t < ctx; t++) {
                sc[t] = expf(sc[t] - mx);
                sum += sc[t];
            }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < ctx; t++) sc[t] *= inv;
        }

        memset(os, 0, sizeof(float) * nh * hd);
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const float *vb = cache + table[t0 / block_size] * block_stride + v_off;
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
            for (int64_t j = 0; j < n; j++) {
                for (int64_t h = 0; h < nh; h++) {
                    const float *v = vb + (j * num_kv_heads + h / groups) * hd;
                    const float p = scores[h * ctx + t0 + j];
                    float *oh = os + h * hd;
                    for (int64_t i = 0; i < hd; i++) oh[i] += p * v[i];
                }
            }
        }
    }
}
