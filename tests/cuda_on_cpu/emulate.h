// CUDA's execution model on the CPU, for testing csrc/cuda/*.cu where no GPU is: every thread of a block
// is a fiber (ucontext) on the calling OS thread, __syncthreads and warp shuffles are barriers at which a
// fiber yields to the next, and blocks run one after another (so __shared__ variables can be statics, and
// dynamic shared memory one buffer, poisoned with NaN before each block). It checks the kernels' logic
// (indexing, reductions, masks, the math), not what only a GPU shows (memory ordering between blocks,
// speed). When every live thread waits at a barrier that cannot open (a thread skipped a __syncthreads or
// a shuffle its peers reached: a GPU would hang) it aborts with a message.
//
// tests/emulated_cuda.py compiles the .cu files as C++ against these headers, after two textual changes:
// `extern __shared__ T name[];` becomes a pointer to the dynamic buffer and `k<<<g, b, s, st>>>(args)`
// becomes emulate::launch(k, g, b, s, st, args).
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
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

// The running fiber's; the scheduler sets them before it resumes one.
inline dim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim, gridDim;

typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

namespace emulate {

constexpr size_t kMaxDynamicShared = 227 * 1024;  // an H100/H200 block's opt-in limit
constexpr size_t kStackBytes = 64 * 1024;          // a fiber's: the kernels' locals are small arrays
inline cudaError_t last_error = cudaSuccess;
inline uint64_t progress = 0;  // arrivals, releases and exits: a scheduler round without any is a deadlock

void yield();

class Barrier {
 public:
  explicit Barrier(int n = 0) : n_(n) {}
  void wait() {
    ++progress;
    const uint64_t generation = generation_;
    if (++arrived_ == n_) return release();
    while (generation_ == generation) yield();
  }
  void leave() {  // an exited thread no longer holds the barrier up, as on the GPU
    ++progress;
    if (--n_ > 0 && arrived_ == n_) release();
  }

 private:
  void release() {
    arrived_ = 0;
    ++generation_;
  }
  int n_, arrived_ = 0;
  uint64_t generation_ = 0;
};

struct Fiber {
  ucontext_t context;
  dim3 index;
  bool done = false;
};

struct Block {
  Block(int threads, size_t shared_bytes) : threads(threads), all(threads), lanes(threads), shared((shared_bytes + 7) / 8) {
    for (int w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(std::min(32, threads - 32 * w));
    std::memset(shared.data(), 0xff, shared.size() * 8);  // NaN floats: a read before any write shows
  }
  int threads;
  Barrier all;
  std::vector<Barrier> warps;
  std::vector<uint64_t> lanes;  // shuffles' exchange, a slot per thread
  std::vector<uint64_t> shared;
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = 0;
  std::function<void()> body;
};

inline Block* block = nullptr;

inline void yield() { swapcontext(&block->fibers[block->current].context, &block->scheduler); }

inline void fiber_main() {
  Block& b = *block;
  b.body();
  b.fibers[b.current].done = true;
  b.warps[b.current / 32].leave();
  b.all.leave();
}  // returns to uc_link: the scheduler

inline int linear_thread() { return block->current; }

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(block->shared.data());
}

// Runs the block's threads round-robin, each until it waits at a barrier or exits.
inline void run_block(Block& b, dim3 threads, std::vector<char>& stacks) {
  b.fibers.resize(b.threads);
  for (int t = 0; t < b.threads; ++t) {
    Fiber& f = b.fibers[t];
    f.index = dim3(t % threads.x, t / threads.x % threads.y, t / (threads.x * threads.y));
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stacks.data() + size_t(t) * kStackBytes;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &b.scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  for (int live = b.threads; live > 0;) {
    const uint64_t before = progress;
    live = 0;
    for (int t = 0; t < b.threads; ++t) {
      if (b.fibers[t].done) continue;
      b.current = t;
      threadIdx = b.fibers[t].index;
      swapcontext(&b.scheduler, &b.fibers[t].context);
      live += !b.fibers[t].done;
    }
    if (live > 0 && progress == before) {
      std::fprintf(stderr, "emulated CUDA: deadlock, every live thread waits at a barrier that cannot open "
                           "(a thread skipped a __syncthreads or a shuffle its peers reached)\n");
      std::abort();
    }
  }
}

template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 threads, size_t shared_bytes, cudaStream_t, A... args) {
  static std::mutex one_at_a_time;  // the scheduler's state is global
  const std::lock_guard<std::mutex> lock(one_at_a_time);
  const unsigned n = threads.x * threads.y * threads.z;
  if (n == 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || shared_bytes > kMaxDynamicShared) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  std::vector<char> stacks(size_t(n) * kStackBytes);
  blockDim = threads;
  gridDim = grid;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b(int(n), shared_bytes);
        b.body = [&] { kernel(args...); };
        blockIdx = dim3(bx, by, bz);
        block = &b;
        run_block(b, threads, stacks);
        block = nullptr;
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
  b.warps[warp].wait();
  T out = v;  // a lane past the block's last thread gives the caller's own value
  if (source < b.threads) std::memcpy(&out, &b.lanes[source], sizeof(T));
  b.warps[warp].wait();
  return out;
}

inline int atomicAdd(int* address, int v) {  // one fiber runs at a time: plain read-modify-write
  const int old = *address;
  *address = old + v;
  return old;
}

inline int atomicMax(int* address, int v) {
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
