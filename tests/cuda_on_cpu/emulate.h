// CUDA's execution model on the CPU, for testing csrc/cuda/*.cu where no GPU is: every thread of a block
// is an OS thread, __syncthreads and warp shuffles are barriers, blocks run one after another (so
// __shared__ variables can be statics, and dynamic shared memory one buffer, poisoned with NaN before
// each block). It checks the kernels' logic (indexing, reductions, masks, the math), not what only a GPU
// shows (memory ordering between blocks, speed). A barrier that waits 60 s aborts: a thread that skipped
// a __syncthreads or a shuffle its peers reached deadlocks a GPU too.
//
// tests/emulated_cuda.py compiles the .cu files as C++ against these headers, after two textual changes:
// `extern __shared__ T name[];` becomes a pointer to the dynamic buffer and `k<<<g, b, s, st>>>(args)`
// becomes emulate::launch(k, g, b, s, st, args).
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim, gridDim;

typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

namespace emulate {

constexpr size_t kMaxDynamicShared = 227 * 1024;  // an H100/H200 block's opt-in limit
inline cudaError_t last_error = cudaSuccess;

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const uint64_t generation = generation_;
    if (++arrived_ == n_) return release();
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return generation_ != generation; })) {
      std::fprintf(stderr, "emulated CUDA: a barrier waited 60 s (a thread skipped a __syncthreads or shuffle)\n");
      std::abort();
    }
  }
  void leave() {  // an exited thread no longer holds a barrier up, as on the GPU
    std::unique_lock<std::mutex> lock(m_);
    if (--n_ > 0 && arrived_ == n_) release();
  }

 private:
  void release() {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
  }
  std::mutex m_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  uint64_t generation_ = 0;
};

struct Block {
  explicit Block(int threads, size_t shared_bytes)
      : threads(threads), all(threads), lanes(threads), shared((shared_bytes + 7) / 8) {
    for (int w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(new Barrier(std::min(32, threads - 32 * w)));
    std::memset(shared.data(), 0xff, shared.size() * 8);  // NaN floats: a read before any write shows
  }
  int threads;
  Barrier all;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<uint64_t> lanes;  // shuffles' exchange, a slot per thread
  std::vector<uint64_t> shared;
};

inline thread_local Block* block = nullptr;
inline std::mutex atomics;

inline int linear_thread() { return int(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)); }

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(block->shared.data());
}

template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 threads, size_t shared_bytes, cudaStream_t, A... args) {
  const unsigned n = threads.x * threads.y * threads.z;
  if (n == 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || shared_bytes > kMaxDynamicShared) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b(int(n), shared_bytes);
        std::vector<std::thread> pool;
        for (unsigned t = 0; t < n; ++t)
          pool.emplace_back([&, t] {
            block = &b;
            threadIdx = dim3(t % threads.x, t / threads.x % threads.y, t / (threads.x * threads.y));
            blockIdx = dim3(bx, by, bz);
            blockDim = threads;
            gridDim = grid;
            kernel(args...);
            b.warps[t / 32]->leave();
            b.all.leave();
          });
        for (auto& thread : pool) thread.join();
      }
}

}  // namespace emulate

inline void __syncthreads() { emulate::block->all.wait(); }

// `width` other than 32 is not emulated (the kernels do not use it).
template <typename T>
T __shfl_xor_sync(unsigned /*mask*/, T v, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle moves one register");
  emulate::Block& b = *emulate::block;
  const int t = emulate::linear_thread(), warp = t / 32, source = warp * 32 + ((t % 32) ^ lane_mask);
  std::memcpy(&b.lanes[t], &v, sizeof(T));
  b.warps[warp]->wait();
  T out = v;  // a lane past the block's last thread gives the caller's own value
  if (source < b.threads) std::memcpy(&out, &b.lanes[source], sizeof(T));
  b.warps[warp]->wait();
  return out;
}

inline int atomicAdd(int* address, int v) {
  std::lock_guard<std::mutex> lock(emulate::atomics);
  const int old = *address;
  *address = old + v;
  return old;
}

inline int atomicMax(int* address, int v) {
  std::lock_guard<std::mutex> lock(emulate::atomics);
  const int old = *address;
  *address = std::max(old, v);
  return old;
}

template <typename F>
cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int value) {
  return value < 0 || size_t(value) > emulate::kMaxDynamicShared ? cudaErrorInvalidValue : cudaSuccess;
}

inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = emulate::last_error;
  emulate::last_error = cudaSuccess;
  return e;
}
