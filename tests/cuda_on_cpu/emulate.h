// CUDA's execution model on the CPU, for testing csrc/cuda/*.cu where no GPU is: every thread of a block
// is a fiber (ucontext) on the calling OS thread, __syncthreads and warp shuffles are barriers at which a
// fiber yields to the next, and blocks run one after another (so __shared__ variables can be statics, and
// dynamic shared memory one buffer, poisoned with NaN before each block and guarded past its end). Blocks
// alternate the order their threads run in (first to last, then last to first), so a missing
// __syncthreads between a write and another thread's read shows one way or the other. It checks the
// kernels' logic (indexing, reductions, masks, the math), not what only a GPU shows (memory ordering
// between blocks, speed). It aborts with a message where a GPU would hang or misbehave: every live thread
// waiting at a barrier that cannot open, a shuffle reading an exited thread's lane, a write past the
// dynamic shared memory, a fiber's stack overflowing (guard pages). Static __shared__ variables are not
// poisoned between blocks.
//
// tests/emulated_cuda.py compiles the .cu files as C++ against these headers, after two textual changes:
// `extern __shared__ T name[];` becomes a pointer to the dynamic buffer and `k<<<g, b, s, st>>>(args)`
// becomes emulate::launch(k, g, b, s, st, args).
#pragma once
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
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

constexpr size_t kMaxDynamicShared = 227 * 1024;    // an H100/H200 block's opt-in limit
constexpr size_t kDefaultDynamicShared = 48 * 1024;  // without cudaFuncSetAttribute raising it
constexpr size_t kStackBytes = 64 * 1024;            // a fiber's: the kernels' locals are small arrays
constexpr size_t kPage = 4096;
constexpr size_t kSharedGuard = 1024;  // bytes past the dynamic shared memory that must stay untouched
inline std::map<const void*, size_t> dynamic_shared_limit;  // per kernel, as cudaFuncSetAttribute set it
inline uint64_t blocks_run = 0;
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
  Block(int threads, size_t shared_bytes)
      : threads(threads), all(threads), lanes(threads), shared_bytes(shared_bytes), shared((shared_bytes + kSharedGuard + 7) / 8) {
    for (int w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(std::min(32, threads - 32 * w));
    std::memset(shared.data(), 0xff, shared.size() * 8);  // NaN floats: a read before any write shows
  }
  bool shared_guard_intact() const {
    const auto* bytes = reinterpret_cast<const unsigned char*>(shared.data());
    for (size_t i = shared_bytes; i < shared_bytes + kSharedGuard; ++i)
      if (bytes[i] != 0xff) return false;
    return true;
  }
  int threads;
  Barrier all;
  std::vector<Barrier> warps;
  std::vector<uint64_t> lanes;  // shuffles' exchange, a slot per thread
  size_t shared_bytes;
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

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emulated CUDA: %s\n", what);
  std::abort();
}

// Fiber stacks, each above a PROT_NONE page: an overflow faults instead of corrupting the next stack.
struct Stacks {
  explicit Stacks(unsigned n) : bytes(n * (kStackBytes + kPage)) {
    base = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (base == MAP_FAILED) fail("no memory for the fibers' stacks");
    for (unsigned t = 0; t < n; ++t) mprotect(base + t * (kStackBytes + kPage), kPage, PROT_NONE);
  }
  ~Stacks() { munmap(base, bytes); }
  char* stack(int t) const { return base + size_t(t) * (kStackBytes + kPage) + kPage; }
  size_t bytes;
  char* base;
};

// Runs the block's threads round-robin, each until it waits at a barrier or exits; odd blocks last to first.
inline void run_block(Block& b, dim3 threads, const Stacks& stacks) {
  b.fibers.resize(b.threads);
  for (int t = 0; t < b.threads; ++t) {
    Fiber& f = b.fibers[t];
    f.index = dim3(t % threads.x, t / threads.x % threads.y, t / (threads.x * threads.y));
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stacks.stack(t);
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &b.scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  const bool reverse = blocks_run++ % 2 == 1;
  for (int live = b.threads; live > 0;) {
    const uint64_t before = progress;
    live = 0;
    for (int i = 0; i < b.threads; ++i) {
      const int t = reverse ? b.threads - 1 - i : i;
      if (b.fibers[t].done) continue;
      b.current = t;
      threadIdx = b.fibers[t].index;
      swapcontext(&b.scheduler, &b.fibers[t].context);
      live += !b.fibers[t].done;
    }
    if (live > 0 && progress == before)
      fail("deadlock, every live thread waits at a barrier that cannot open (a thread skipped a "
           "__syncthreads or a shuffle its peers reached)");
  }
  if (!b.shared_guard_intact()) fail("a thread wrote past the end of the dynamic shared memory");
}

template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 threads, size_t shared_bytes, cudaStream_t, A... args) {
  static std::mutex one_at_a_time;  // the scheduler's state is global
  const std::lock_guard<std::mutex> lock(one_at_a_time);
  const unsigned n = threads.x * threads.y * threads.z;
  const auto raised = dynamic_shared_limit.find(reinterpret_cast<const void*>(kernel));
  const size_t limit = raised == dynamic_shared_limit.end() ? kDefaultDynamicShared : raised->second;
  if (n == 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || shared_bytes > limit) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  const Stacks stacks(n);
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
  // A full mask naming a lane past the block or an exited thread is undefined on a GPU.
  if (source >= b.threads || b.fibers[source].done) emulate::fail("a shuffle read a lane with no live thread");
  T out;
  std::memcpy(&out, &b.lanes[source], sizeof(T));
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
cudaError_t cudaFuncSetAttribute(F kernel, cudaFuncAttribute, int value) {
  if (value < 0 || size_t(value) > emulate::kMaxDynamicShared) return cudaErrorInvalidValue;
  emulate::dynamic_shared_limit[reinterpret_cast<const void*>(kernel)] = size_t(value);
  return cudaSuccess;
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
