// What compute-sanitizer's racecheck makes of the block-scale staging protocol, on a kernel small enough to read
// (session 31). A producer warp fills a ring of shared-memory slots from global memory; consumer warps read them
// and hand them back; mbarriers order both ways, as in kernels/sm90 (block_scales.ScaleStaging, stage_release):
//   producer: wait empty[s]; write slot s; arrive on full[s]
//   consumers: wait full[s]; LDS slot s; release empty[s]
// Variants (argv[1]):
//   0  cp.async 4-byte copies + cp.async.mbarrier.arrive.noinc; one lane per consumer warp releases (the kernels')
//   1  as 0, __syncwarp() before the release
//   2  as 0, every consumer lane releases
//   3  plain st.shared + mbarrier.arrive by every producer lane; one lane per consumer warp releases
// Every variant checks its sums; the protocol is correct by the PTX memory model in 0-3 except where a lane's
// read is ordered before another lane's release only by warp convergence (0, 3).
//   nvcc -arch=sm_90a -o /tmp/rc benchmarks/racecheck_probe.cu && for v in 0 1 2 3; do
//     compute-sanitizer --tool racecheck /tmp/rc $v; done
#include <cstdio>
#include <cstdlib>
#include <cstdint>

constexpr int kStages = 4, kSlot = 128, kIters = 64, kConsumerWarps = 4;

__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem(b)), "r"(n));
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.shared.b64 st, [%0]; }" ::"r"(smem(b)) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* b, int parity) {
  asm volatile(
      "{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1; @!p bra W; }" ::"r"(smem(b)), "r"(parity)
      : "memory");
}

__global__ void probe(const float* src, float* out, int variant) {
  __shared__ alignas(16) float slots[kStages][kSlot];
  __shared__ uint64_t full[kStages], empty[kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int releasers = variant == 2 ? 32 * kConsumerWarps : kConsumerWarps;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      bar_init(&full[s], 32);
      bar_init(&empty[s], releasers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {  // producer
    for (int it = 0; it < kIters; ++it) {
      const int s = it % kStages;
      if (it >= kStages) bar_wait(&empty[s], ((it / kStages) - 1) & 1);
      for (int i = lane; i < kSlot; i += 32) {
        const float* g = src + it * kSlot + i;
        if (variant == 3) {
          slots[s][i] = *g;
        } else {
          asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem(&slots[s][i])), "l"(g) : "memory");
        }
      }
      if (variant == 3) {
        bar_arrive(&full[s]);
      } else {
        asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(smem(&full[s])) : "memory");
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else {  // consumers: each lane sums its columns of every slot
    float acc = 0.f;
    for (int it = 0; it < kIters; ++it) {
      const int s = it % kStages;
      bar_wait(&full[s], (it / kStages) & 1);
      for (int i = lane; i < kSlot; i += 32) acc += slots[s][i] * (1 + (warp - 1));
      if (variant == 1) __syncwarp();
      if (variant == 2 || lane == 0) bar_arrive(&empty[s]);
    }
    out[(warp - 1) * 32 + lane] = acc;
  }
}

int main(int argc, char** argv) {
  const int variant = argc > 1 ? atoi(argv[1]) : 0;
  const int n = kIters * kSlot;
  float *src, *out;
  cudaMallocManaged(&src, n * sizeof(float));
  cudaMallocManaged(&out, 32 * kConsumerWarps * sizeof(float));
  for (int i = 0; i < n; ++i) src[i] = float(i % 7);
  probe<<<1, 32 * (1 + kConsumerWarps)>>>(src, out, variant);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    printf("variant %d: launch failed\n", variant);
    return 2;
  }
  int bad = 0;
  for (int w = 0; w < kConsumerWarps; ++w)
    for (int l = 0; l < 32; ++l) {
      double want = 0;
      for (int it = 0; it < kIters; ++it)
        for (int i = l; i < kSlot; i += 32) want += src[it * kSlot + i] * (1 + w);
      bad += out[w * 32 + l] != float(want);
    }
  printf("variant %d: %s\n", variant, bad ? "WRONG sums" : "sums right");
  return bad ? 1 : 0;
}
