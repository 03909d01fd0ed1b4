// The extension's threads: one pool for every op that splits its work (the paged
// attention, linear_ops' weight matmuls).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#ifdef __linux__
#include <pthread.h>
#endif

namespace mlxq {

// A small pool: parallel_for(n, fn) runs fn(0..n-1) on the workers and the
// calling thread (MLX's CPU stream thread). Workers sleep on a condition
// variable between steps (after a short watch for the next call, spin_for_call),
// so an idle pool takes no cycles from BLAS or Redis I/O.
//
// The caller never waits for a worker that has not started: a task is claimed
// by a compare-and-swap on (generation, next index), and the caller waits only
// for tasks a worker has claimed. On 2 cores an idle OpenBLAS thread spins on
// the other core (it does not yield), and a woken worker may get that core only
// at the scheduler's next tick, milliseconds later: waiting for it to check in
// made every attention call as slow as that wake-up. A worker that wakes after
// its call has ended finds the generation moved on and claims nothing.
class ThreadPool {
 public:
  explicit ThreadPool(int n) {
    for (int i = 1; i < n; ++i)
      workers_.emplace_back([this] {
#ifdef __linux__
        // Named, so that top -H, perf and bench/profile_step.py --threads can tell it apart.
        pthread_setname_np(pthread_self(), "mlxq-pool");
#endif
        loop();
      });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_)
      t.join();
  }

  int size() const {
    return (int)workers_.size() + 1;
  }

  // See spin_for_call.
  void set_spin_us(int us) {
    spin_us_.store(us < 0 ? 0 : us, std::memory_order_relaxed);
  }

  void parallel_for(int n, const std::function<void(int)>& fn) {
    if (n <= 0)
      return;
    if (n == 1 || workers_.empty()) {
      for (int i = 0; i < n; ++i)
        fn(i);
      return;
    }
    std::lock_guard<std::mutex> call(call_mu_);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen = gen_.fetch_add(1, std::memory_order_release) + 1;
      fn_ = &fn;
      n_ = n;
      done_.store(0);
      claim_.store(gen << 32);
    }
    cv_.notify_all();
    work(gen, fn, n);
    spin_for_done(n);
    if (done_.load() != n) {
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, [&] { return done_.load() == n; });
    }
    // Every index is claimed (a late worker's claim fails); nothing to hand out now.
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = nullptr;
  }

 private:
  // Claim and run tasks of generation ``gen`` until none is left.
  void work(uint64_t gen, const std::function<void(int)>& fn, int n) {
    for (;;) {
      uint64_t c = claim_.load();
      int i;
      do {
        i = (int)(c & 0xffffffffu);
        if ((c >> 32) != gen || i >= n)
          return;
      } while (!claim_.compare_exchange_weak(c, c + 1));
      fn(i);
      if (done_.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lk(mu_);
        done_cv_.notify_one();
      }
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      spin_for_call(seen);
      const std::function<void(int)>* fn;
      int n;
      uint64_t gen;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (gen_ != seen && fn_ != nullptr); });
        if (stop_)
          return;
        gen = seen = gen_;
        fn = fn_;
        n = n_;
      }
      // fn stays valid while a task of this generation is unfinished, and a
      // task is claimed only while the generation is current.
      work(gen, *fn, n);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0;
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};
  std::atomic<uint64_t> gen_{0};  // written under mu_; read without it by spin_for_call

  // Between calls a worker watches for the next one for up to spin_us_ (MLXQ_POOL_SPIN_US, 0: sleep
  // at once) before it sleeps, and the caller, its own tasks done, watches for the ones a worker
  // claimed before it sleeps on done_cv_. A decode step calls the pool a few times a layer, every few
  // tens of microseconds at one row, and a sleep and a wake-up cost as much as a call's share of the
  // work: a profile of a solo step showed a sixth of it in the kernel's scheduler. Measured end to end
  // (SmolLM2 through Redis, 2026-12-02): 100 us against 0 made solo int8-dot decoding ~15% faster,
  // and 16 and 64 concurrent 4-10% faster on both the fp32 and the int8-dot weights.
  void spin_for_call(uint64_t seen) {
    watch([&] { return gen_.load(std::memory_order_acquire) != seen; });
  }
  void spin_for_done(int n) {
    watch([&] { return done_.load(std::memory_order_acquire) == n; });
  }
  template <class Ready>
  void watch(const Ready& ready) {
    const int us = spin_us_.load(std::memory_order_relaxed);
    if (us <= 0)
      return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
    for (int i = 0;; ++i) {
      if (ready())
        return;
      cpu_relax();
      if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until)
        return;
    }
  }

  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  std::atomic<int> spin_us_{100};
  bool stop_ = false;
};

// The process's pool (MLXQ_ATTN_THREADS threads, default: the CPUs this process may
// run on), made on first use, and again in a forked child.
ThreadPool& pool();

// Threads the pool runs on.
int num_threads();

// Floats an op's call touches from which its work splits over the pool (waking a worker costs
// ~10-25 us): a batch-64 decode step's activations (64 x 512) and more.
constexpr int64_t kSplitFloats = 1 << 15;

// fn(lo, hi) over items [0, n) in contiguous ranges, each starting at a multiple of `align` items:
// up to 2 * size() of them on the pool where the call touches `floats` >= kSplitFloats, else one,
// fn(0, n), here. For work whose every item's result is its own, whichever range and thread
// computes it.
template <class F>
void split_ranges(ThreadPool& tp, int64_t n, int64_t floats, int64_t align, const F& fn) {
  const int64_t units = (n + align - 1) / align;
  const int parts = floats >= kSplitFloats ? (int)std::min<int64_t>(units, 2 * tp.size()) : 1;
  if (parts <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  tp.parallel_for(parts, [&](int p) {
    fn(std::min(n, units * p / parts * align), std::min(n, units * (p + 1) / parts * align));
  });
}

} // namespace mlxq
