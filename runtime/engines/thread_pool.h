// spectrt's thread pool for the native forward: persistent workers that claim work as they go.
//
// Why not at::parallel_for (OpenMP), as before: each of a forward's ~150 parallel regions split its items statically
// and ended in a barrier, so one thread the OS had descheduled (another process on the core, a Kubernetes CPU limit)
// stalled every region for a scheduler time slice: one busy process on a 2-core box cut served throughput 54x.
// Here a parallel_for publishes its items and every participant (the caller included) claims chunks from one atomic
// counter, guided (each claim takes its share of what is left): a thread that is late, asleep or descheduled simply
// claims nothing, and the others take its share. Only a chunk a thread has already claimed can hold the caller up.
// Waiting is bounded spinning (with sched_yield, so a thread sharing the core gets it), then a futex sleep: workers
// sleep between forwards, and a caller whose last chunk is held by a descheduled worker sleeps until it is done.
//
// The caller never needs a worker to make progress: with no worker awake (or none alive, after a fork) it claims every
// chunk itself. A second caller while a loop runs (another thread's forward) runs its loop inline, in the same order.
// Which thread computes a chunk never changes a result: every output (a GEMM panel, an attention task) is computed by
// one thread in a fixed order, so outputs are bitwise the same with any thread count and any claim order.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pool {

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spin until `done()` or `spin_us` have passed: pause a while, then sched_yield (a thread waiting for a thread on
// the same core hands it the core). Returns done().
template <typename Done>
inline bool spin_until(Done&& done, int64_t spin_us) {
  using clock = std::chrono::steady_clock;
  for (int i = 0; i < 64; ++i) {  // the common case inside a forward: the next job or the last chunk is moments away
    if (done()) return true;
    cpu_relax();
  }
  const auto end = clock::now() + std::chrono::microseconds(spin_us);
  while (clock::now() < end) {
    for (int i = 0; i < 16; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    sched_yield();
  }
  return done();
}

// Counters for tests and profiles (monotonic, relaxed: read them while nothing runs).
struct Stats {
  std::atomic<uint64_t> loops{0};          // parallel loops dispatched to the pool (not the inline ones)
  std::atomic<uint64_t> inline_loops{0};   // loops run inline: one thread, one item, or another caller's loop busy
  std::atomic<uint64_t> caller_items{0};   // items the calling thread computed
  std::atomic<uint64_t> worker_items{0};   // items workers computed
  std::atomic<uint64_t> worker_sleeps{0};  // times a worker went to sleep (futex) between loops
  std::atomic<uint64_t> caller_sleeps{0};  // times a caller slept waiting for a chunk a worker held
};

class Pool {
 public:
  using Fn = void (*)(void* ctx, int64_t begin, int64_t end);

  static Pool& get() {  // never destroyed: workers may still be asleep in it at exit
    static Pool* pool = new Pool();
    return *pool;
  }

  // f(begin, end) over [0, n) in chunks, on `threads` threads (the caller and threads - 1 workers).
  template <typename F>
  void parallel_for(int64_t n, int threads, F&& f) {
    if (n <= 0) return;
    auto call = [](void* ctx, int64_t b, int64_t e) { (*static_cast<std::remove_reference_t<F>*>(ctx))(b, e); };
    std::unique_lock<std::mutex> lock(caller_, std::try_to_lock);
    if (threads <= 1 || n == 1 || !lock.owns_lock() || n > INT32_MAX) {
      stats.inline_loops.fetch_add(1, std::memory_order_relaxed);
      f(0, n);
      return;
    }
    run(n, threads, call, &f);
  }

  Stats stats;
  std::atomic<int64_t> spin_us{50};            // how long a waiting thread spins before it sleeps
  std::atomic<int64_t> worker_delay_us{0};     // tests: each worker sleeps this long before it claims a new loop
  int workers() const { return static_cast<int>(started_.load()); }

 private:
  struct Job {
    std::atomic<Fn> fn{nullptr};
    std::atomic<void*> ctx{nullptr};
    std::atomic<int64_t> n{0};
    std::atomic<int> threads{0};
    std::atomic<uint32_t> done{0};     // items finished (futex word of a sleeping caller)
    std::atomic<bool> caller_asleep{false};
  };

  Pool() = default;

  // Claims chunks of loop `gen` until none is left; returns the items this thread computed.
  int64_t work(uint32_t gen, Job& job) {
    int64_t mine = 0;
    uint64_t word = claim_.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(word >> 32) != gen) return mine;
      // read after the generation matched; if the job was replaced meanwhile, the CAS below fails (new generation)
      const int64_t n = job.n.load(std::memory_order_relaxed), threads = job.threads.load(std::memory_order_relaxed);
      const int64_t begin = static_cast<uint32_t>(word);
      if (begin >= n) return mine;
      const int64_t chunk = std::max<int64_t>(1, (n - begin) / threads), end = std::min(n, begin + chunk);
      if (!claim_.compare_exchange_weak(word, (static_cast<uint64_t>(gen) << 32) | static_cast<uint64_t>(end),
                                        std::memory_order_acq_rel, std::memory_order_acquire))
        continue;
      // [begin, end) is ours: the loop cannot finish (nor its job be reused) before `done` counts it
      job.fn.load(std::memory_order_relaxed)(job.ctx.load(std::memory_order_relaxed), begin, end);
      mine += end - begin;
      const uint32_t total = job.done.fetch_add(static_cast<uint32_t>(end - begin)) + (end - begin);
      if (total == n && job.caller_asleep.load()) futex_wake_all(&job.done);
      word = claim_.load(std::memory_order_acquire);
    }
  }

  void run(int64_t n, int threads, Fn fn, void* ctx) {
    start_workers(threads - 1);
    const uint32_t gen = ++gen_;  // only the caller holding `caller_` writes it
    Job& job = jobs_[gen & 1];    // the other job may still be read by a late worker; its CAS then fails
    job.fn.store(fn, std::memory_order_relaxed);
    job.ctx.store(ctx, std::memory_order_relaxed);
    job.n.store(n, std::memory_order_relaxed);
    job.threads.store(threads, std::memory_order_relaxed);
    job.done.store(0, std::memory_order_relaxed);
    job.caller_asleep.store(false, std::memory_order_relaxed);
    claim_.store(static_cast<uint64_t>(gen) << 32);  // publishes the job (seq_cst: ordered before the sleepers check)
    wake_.fetch_add(1);
    if (sleepers_.load() > 0) futex_wake_all(&wake_);
    stats.loops.fetch_add(1, std::memory_order_relaxed);
    stats.caller_items.fetch_add(work(gen, job), std::memory_order_relaxed);
    const auto finished = [&] { return job.done.load(std::memory_order_acquire) == n; };
    while (!spin_until(finished, spin_us.load(std::memory_order_relaxed))) {
      job.caller_asleep.store(true);  // seq_cst against the worker's done update and its check of this flag
      const uint32_t seen = job.done.load();
      if (seen == n) break;
      stats.caller_sleeps.fetch_add(1, std::memory_order_relaxed);
      futex_wait(&job.done, seen);
    }
  }

  void start_workers(int wanted) {
    while (started_.load() < wanted) {
      const int id = started_.fetch_add(1);
      std::thread([this, id] { worker(id); }).detach();
    }
  }

  void worker(int id) {
    uint32_t seen = static_cast<uint32_t>(claim_.load() >> 32);
    for (;;) {
      const auto fresh = [&] { return static_cast<uint32_t>(claim_.load(std::memory_order_acquire) >> 32) != seen; };
      if (!spin_until(fresh, spin_us.load(std::memory_order_relaxed))) {
        const uint32_t ticket = wake_.load();
        sleepers_.fetch_add(1);
        if (!fresh()) {
          stats.worker_sleeps.fetch_add(1, std::memory_order_relaxed);
          futex_wait(&wake_, ticket);  // returns at once if a loop was published since `ticket`
        }
        sleepers_.fetch_sub(1);
        continue;
      }
      seen = static_cast<uint32_t>(claim_.load(std::memory_order_acquire) >> 32);
      if (const int64_t delay = worker_delay_us.load(std::memory_order_relaxed))
        std::this_thread::sleep_for(std::chrono::microseconds(delay));
      Job& job = jobs_[seen & 1];
      if (id + 1 >= job.threads.load(std::memory_order_relaxed)) continue;  // this loop wants fewer threads
      const int64_t mine = work(seen, job);
      stats.worker_items.fetch_add(mine, std::memory_order_relaxed);
    }
  }

  std::mutex caller_;                   // one loop on the pool at a time; other callers run theirs inline
  uint32_t gen_ = 0;                    // the last loop's generation (caller only)
  Job jobs_[2];                         // by generation parity
  std::atomic<uint64_t> claim_{0};      // generation << 32 | next unclaimed item
  std::atomic<uint32_t> wake_{0};       // bumped at every loop: the futex word sleeping workers wait on
  std::atomic<int> sleepers_{0};
  std::atomic<int> started_{0};
};

}  // namespace pool
