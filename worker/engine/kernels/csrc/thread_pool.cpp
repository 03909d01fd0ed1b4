// The extension's thread pool: its size and the process-wide instance; see thread_pool.h.
#include "thread_pool.h"

#include <cstdlib>
#include <new>

#ifdef __linux__
#include <sched.h>
#endif
#include <pthread.h>

namespace mlxq {
namespace {

int default_threads() {
  if (const char* env = std::getenv("MLXQ_ATTN_THREADS")) {
    int n = std::atoi(env);
    if (n > 0)
      return n;
  }
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0)
      return n;
  }
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? (int)n : 1;
}

std::mutex g_pool_mu;
ThreadPool* g_pool = nullptr;

// A forked child has none of the parent's threads: forget the pool (leaked on
// purpose, its threads do not exist) and make a new one on first use.
void forget_pool_in_child() {
  g_pool = nullptr;
  new (&g_pool_mu) std::mutex();
}

} // namespace

ThreadPool& pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (g_pool == nullptr) {
    static bool registered = [] {
      pthread_atfork(nullptr, nullptr, forget_pool_in_child);
      return true;
    }();
    (void)registered;
    g_pool = new ThreadPool(default_threads());
    if (const char* env = std::getenv("MLXQ_POOL_SPIN_US"))
      g_pool->set_spin_us(std::atoi(env));
  }
  return *g_pool;
}

int num_threads() {
  return pool().size();
}

} // namespace mlxq
