// stream_probe.cu - how fast one persistent kernel can stream a 7B 4-bit decode step's weights
// (q/k/v, o, gate/up and down of 32 layers, then a 6-bit head: 3.4 GB) through shared memory with
// TMA bulk copies, with and without a grid-wide barrier between the ops (the dependency a decode
// megakernel would have), against the device-to-device copy rate. A measurement for planning the
// decode kernels (bench/RESULTS.md), not part of the engine. One producer lane per block streams its
// share of every op through a ring of STAGES x 16 KiB without waiting for the barriers; 8 consumer
// warps read each stage (work 0: one XOR per 16 bytes; work 1: the dequantize-and-FMA instructions of
// a 4-bit one-row GEMV) and wait, per op, until every block has finished the op before.
// Build (sm_90): nvcc -O3 -arch=sm_90a -std=c++17 -o stream_probe bench/stream_probe.cu
// Usage on the GPU machine: stream_probe [work 0|1] [barriers 0|1]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <vector>

#ifndef STAGES
#define STAGES 6
#endif
#define STAGE_BYTES 16384
#define CONSUMERS 8

struct Op {
    unsigned long long off, bytes;
};

__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t *b, unsigned n) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_expect(uint64_t *b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *b) {
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *b, unsigned parity) {
    asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n@!p bra W;\n}" ::"r"(
                     smem_u32(b)),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, unsigned bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

__global__ void __launch_bounds__((CONSUMERS + 1) * 32, 1)
    probe(const unsigned char *w, const Op *ops, int n_ops, unsigned *done, int work, int barriers, float *sink) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ uint64_t full[STAGES], empty[STAGES];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, G = gridDim.x, b = blockIdx.x;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], CONSUMERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == CONSUMERS) { /* producer: weights never wait for activations */
        if (lane == 0) {
            unsigned it = 0;
            for (int o = 0; o < n_ops; o++) {
                unsigned long long per = (ops[o].bytes / G + 15) / 16 * 16, lo = b * per,
                                   hi = min(ops[o].bytes, lo + per);
                for (unsigned long long p = lo; p < hi; p += STAGE_BYTES, it++) {
                    const int s = it % STAGES;
                    if (it >= STAGES)
                        mbar_wait(&empty[s], ((it / STAGES) - 1) & 1);
                    unsigned n = (unsigned)min((unsigned long long)STAGE_BYTES, hi - p);
                    mbar_expect(&full[s], n);
                    bulk_copy(ring + s * STAGE_BYTES, w + ops[o].off + p, n, &full[s]);
                }
            }
        }
        return;
    }
    float acc = 0.0f;
    unsigned it = 0;
    __half2 h = __float2half2_rn(0.0f), x = __float2half2_rn(1.0f);
    for (int o = 0; o < n_ops; o++) {
        if (barriers && o > 0) { /* the op's activations: every block finished op o - 1 */
            if (threadIdx.x == 0) {
                unsigned v;
                do {
                    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(done + o - 1));
                } while (v < (unsigned)G);
            }
            asm volatile("bar.sync 1, %0;" ::"r"(CONSUMERS * 32));
        }
        unsigned long long per = (ops[o].bytes / G + 15) / 16 * 16, lo = b * per, hi = min(ops[o].bytes, lo + per);
        for (unsigned long long p = lo; p < hi; p += STAGE_BYTES, it++) {
            const int s = it % STAGES;
            mbar_wait(&full[s], (it / STAGES) & 1);
            unsigned n = (unsigned)min((unsigned long long)STAGE_BYTES, hi - p);
            const uint4 *q = (const uint4 *)(ring + s * STAGE_BYTES);
            for (unsigned i = threadIdx.x; i < n / 16; i += CONSUMERS * 32) {
                uint4 v = q[i];
                if (work == 0) {
                    acc += __uint_as_float(v.x ^ v.y ^ v.z ^ v.w);
                } else { /* ~ a 4-bit one-row GEMV: per word 4 x (mask | 0x6400, sub, fma) */
                    uint32_t ws[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int k = 0; k < 4; k++)
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            uint32_t u = ((ws[k] >> (4 * j)) & 0x000f000fu) | 0x64006400u;
                            __half2 c;
                            memcpy(&c, &u, 4);
                            h = __hfma2(__hsub2(c, x), x, h);
                        }
                }
            }
            __syncwarp();
            if (lane == 0)
                mbar_arrive(&empty[s]);
        }
        if (barriers) {
            asm volatile("bar.sync 1, %0;" ::"r"(CONSUMERS * 32));
            if (threadIdx.x == 0) {
                __threadfence();
                atomicAdd(done + o, 1u);
            }
        }
    }
    acc += __low2float(h);
    if (acc == 12345.0f)
        sink[0] = acc;
}

int main(int argc, char **argv) {
    int work = argc > 1 ? atoi(argv[1]) : 0, barriers = argc > 2 ? atoi(argv[2]) : 1;
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    /* 7B 4-bit: q,k,v,o 4096x4096, gate,up 4096x11008, down 11008x4096; 0.5 B a weight + 2 B scale / 128 */
    std::vector<Op> ops;
    unsigned long long off = 0;
    auto add = [&](unsigned long long in, unsigned long long out) {
        unsigned long long bytes = in * out / 2 + in / 128 * out * 2;
        ops.push_back({off, bytes});
        off += (bytes + 255) / 256 * 256;
    };
    for (int l = 0; l < 32; l++) {
        add(4096, 3 * 4096);
        add(4096, 4096);
        add(4096, 2 * 11008);
        add(11008, 4096);
    }
    {
        unsigned long long bytes = 4096ull * 32000 * 6 / 8;
        ops.push_back({off, bytes});
        off += bytes;
    }
    unsigned char *w;
    Op *dops;
    unsigned *done;
    float *sink;
    if (cudaMalloc(&w, off) != cudaSuccess) {
        printf("alloc %llu failed\n", off);
        return 1;
    }
    cudaMemset(w, 1, off);
    cudaMalloc(&dops, ops.size() * sizeof(Op));
    cudaMemcpy(dops, ops.data(), ops.size() * sizeof(Op), cudaMemcpyHostToDevice);
    cudaMalloc(&done, ops.size() * sizeof(unsigned));
    cudaMalloc(&sink, 4);
    size_t smem = STAGES * STAGE_BYTES;
    cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    /* copy bandwidth for the bound */
    unsigned char *c2;
    cudaMalloc(&c2, 1ull << 30);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemcpy(c2, w, 1ull << 30, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e0);
    for (int i = 0; i < 5; i++)
        cudaMemcpy(c2, w, 1ull << 30, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    double copy = 5.0 * 2 * (1ull << 30) / (ms / 1e3);
    double best = 1e9;
    for (int rep = 0; rep < 6; rep++) {
        cudaMemset(done, 0, ops.size() * sizeof(unsigned));
        cudaEventRecord(e0);
        probe<<<sms, (CONSUMERS + 1) * 32, smem>>>(w, dops, (int)ops.size(), done, work, barriers, sink);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) {
            printf("error %s\n", cudaGetErrorString(e));
            return 1;
        }
        cudaEventElapsedTime(&ms, e0, e1);
        if (ms < best)
            best = ms;
    }
    printf(
        "stages %d work %d barriers %d: %.1f GB in %.3f ms = %.0f GB/s, %.1f%% of copy (%.0f GB/s); %zu ops; %.0f tok/s\n",
        STAGES, work, barriers, off / 1e9, best, off / (best / 1e3) / 1e9, 100.0 * off / (best / 1e3) / copy,
        copy / 1e9, ops.size(), 1e3 / best);
    return 0;
}
