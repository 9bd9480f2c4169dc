// spectrt's thread pool for the native forward: persistent workers, work claimed as threads come.
//
// Why not at::parallel_for (OpenMP), as before: each of a forward's ~150 parallel regions split its items statically
// and ended in a barrier, so one thread the OS had descheduled (another process on the core, a Kubernetes CPU limit)
// stalled every region for a scheduler time slice: one busy process on a 2-core box cut served throughput 54x.
// Here a loop's items are split into one contiguous range per participant, as a static schedule would, but each range
// is claimed a chunk at a time: its owner takes chunks from the front (streaming its weight panels in order, the
// panel after each chunk prefetched as before: `Stream`), and a participant whose own range is done takes the back
// half of another's what is left. A thread that is late, asleep or descheduled claims nothing, and the others take its
// range; only a chunk a thread has already claimed can hold the caller up. Waiting is bounded spinning (with
// sched_yield, so a thread sharing the core gets it), then a futex sleep: workers sleep between forwards, and a caller
// whose last chunk is held by a descheduled worker sleeps until it is done.
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

// Spin until `done()` or `spin_us` have passed: first pause only (the common case inside a forward: the next loop or
// the last chunk is a microsecond or two away, and a syscall would delay the answer), after `PURE_SPIN_US` also
// sched_yield (a thread waiting for one on the same core hands it the core). Returns done().
constexpr int64_t PURE_SPIN_US = 10;

template <typename Done>
inline bool spin_until(Done&& done, int64_t spin_us) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto pure = start + std::chrono::microseconds(std::min(PURE_SPIN_US, spin_us));
  const auto end = start + std::chrono::microseconds(spin_us);
  for (auto now = start; now < end; now = clock::now()) {
    for (int i = 0; i < 32; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (now >= pure) sched_yield();
  }
  return done();
}

// Counters for tests and profiles (monotonic, relaxed: read them while nothing runs). Each on a cache line of its own:
// the caller and the workers update theirs every loop, and a shared line would travel between the cores each time.
struct Stats {
  alignas(64) std::atomic<uint64_t> loops{0};          // parallel loops dispatched to the pool (not the inline ones)
  alignas(64) std::atomic<uint64_t> inline_loops{0};   // run inline: one thread, one item, or another loop running
  alignas(64) std::atomic<uint64_t> caller_items{0};   // units the calling thread computed (below 65,536 items a
                                                       // loop, a unit is an item)
  alignas(64) std::atomic<uint64_t> worker_items{0};   // units workers computed
  alignas(64) std::atomic<uint64_t> worker_sleeps{0};  // times a worker went to sleep (futex) between loops
  alignas(64) std::atomic<uint64_t> caller_sleeps{0};  // times a caller slept waiting for a chunk a worker held
};

// What a chunk's caller knows about the stream of items it is part of (GEMM panels prefetch the next one).
struct Stream {
  bool first;  // no earlier chunk of this thread ran just before it (nothing prefetched its first item)
  bool more;   // the item after the chunk is most likely this thread's next (its own range continues)
};

class Pool {
 public:
  using Fn = void (*)(void* ctx, int64_t begin, int64_t end, Stream stream);
  static constexpr int MAX_THREADS = 256;

  static Pool& get() {  // never destroyed: workers may still be asleep in it at exit
    static Pool* pool = new Pool();
    return *pool;
  }

  // f(begin, end[, Stream]) over [0, n) in chunks, on `threads` threads (the caller and threads - 1 workers).
  template <typename F>
  void parallel_for(int64_t n, int threads, F&& f) {
    using Body = std::remove_reference_t<F>;
    if (n <= 0) return;
    std::unique_lock<std::mutex> lock(caller_, std::try_to_lock);
    if (threads <= 1 || n == 1 || !lock.owns_lock()) {
      stats.inline_loops.fetch_add(1, std::memory_order_relaxed);
      invoke(f, 0, n, Stream{true, false});
      return;
    }
    run(n, std::min(threads, MAX_THREADS),
        [](void* ctx, int64_t b, int64_t e, Stream s) { invoke(*static_cast<Body*>(ctx), b, e, s); }, &f);
  }

  Stats stats;
  std::atomic<int64_t> spin_us{50};            // how long a waiting thread spins before it sleeps
  std::atomic<int64_t> worker_delay_us{0};     // tests: each worker sleeps this long before it claims a new loop
  int workers() const { return static_cast<int>(started_.load()); }

 private:
  static constexpr int64_t MAX_UNITS = 0xFFFF;  // claimable units a loop: a range's ends are 16 bits each

  // A loop. Its description is read by every participant at every chunk; `done` is written once by each participant,
  // on a line of its own so that the writes do not take the description's line from the other cores.
  struct alignas(64) Job {
    std::atomic<Fn> fn{nullptr};
    std::atomic<void*> ctx{nullptr};
    std::atomic<int64_t> n{0}, units{0}, unit{1};  // items; claimable units of `unit` items each
    std::atomic<int> threads{0};
    alignas(64) std::atomic<uint32_t> done{0};  // units finished (futex word of a sleeping caller)
    std::atomic<bool> caller_asleep{false};
  };

  // A participant's range of units [front, back) of loop `gen`: generation << 32 | front << 16 | back. The
  // generation makes a claim on an earlier loop's word fail (no ABA before 2^32 loops).
  struct alignas(64) Range {
    std::atomic<uint64_t> word{0};
  };
  static uint64_t pack(uint32_t gen, int64_t front, int64_t back) {
    return static_cast<uint64_t>(gen) << 32 | static_cast<uint64_t>(front) << 16 | static_cast<uint64_t>(back);
  }

  template <typename F>
  static void invoke(F& f, int64_t b, int64_t e, Stream s) {
    if constexpr (std::is_invocable_v<F&, int64_t, int64_t, Stream>)
      f(b, e, s);
    else
      f(b, e);
  }

  Pool() = default;

  // Units [b, e) of the job: its items.
  static void compute(Job& job, int64_t b, int64_t e, Stream s) {
    const int64_t unit = job.unit.load(std::memory_order_relaxed), n = job.n.load(std::memory_order_relaxed);
    job.fn.load(std::memory_order_relaxed)(job.ctx.load(std::memory_order_relaxed), b * unit, std::min(n, e * unit),
                                           s);
  }

  // A participant's computed units into `done`, once, after its last claim (waking a caller asleep for the last).
  static void count_done(Job& job, int64_t mine) {
    if (!mine) return;
    const uint32_t total = job.done.fetch_add(static_cast<uint32_t>(mine)) + static_cast<uint32_t>(mine);
    if (total == job.units.load(std::memory_order_relaxed) && job.caller_asleep.load()) futex_wake_all(&job.done);
  }

  // Participant `me`'s share of loop `gen`: its own range from the front, then the back halves of the others'
  // leftovers. Returns the units it computed, which its caller adds to `done`: a claim succeeds only while the word
  // still holds loop `gen`, and the loop cannot finish (nor its job be reused) before `done` counts every claimed unit.
  int64_t work(uint32_t gen, Job& job, int me) {
    const int threads = job.threads.load(std::memory_order_relaxed);
    int64_t mine = 0;
    bool first = true;
    for (uint64_t w = ranges_[me].word.load(std::memory_order_acquire);;) {
      const int64_t front = (w >> 16) & 0xFFFF, back = w & 0xFFFF;
      if (static_cast<uint32_t>(w >> 32) != gen || front >= back) break;
      const int64_t end = front + std::max<int64_t>(1, (back - front) / 4);
      if (!ranges_[me].word.compare_exchange_weak(w, pack(gen, end, back), std::memory_order_acq_rel,
                                                  std::memory_order_acquire))
        continue;
      compute(job, front, end, Stream{first, end < back});
      mine += end - front;
      first = false;
      w = ranges_[me].word.load(std::memory_order_acquire);
    }
    for (int i = 1; i < threads; ++i) {
      Range& other = ranges_[(me + i) % threads];
      for (uint64_t w = other.word.load(std::memory_order_acquire);;) {
        const int64_t front = (w >> 16) & 0xFFFF, back = w & 0xFFFF;
        if (static_cast<uint32_t>(w >> 32) != gen) return mine;
        if (front >= back) break;
        const int64_t begin = back - std::max<int64_t>(1, (back - front) / 2);
        if (!other.word.compare_exchange_weak(w, pack(gen, front, begin), std::memory_order_acq_rel,
                                              std::memory_order_acquire))
          continue;
        compute(job, begin, back, Stream{true, false});
        mine += back - begin;
        w = other.word.load(std::memory_order_acquire);
      }
    }
    return mine;
  }

  void run(int64_t n, int threads, Fn fn, void* ctx) {
    start_workers(threads - 1);
    const uint32_t gen = ++gen_;  // only the caller holding `caller_` writes it
    Job& job = jobs_[gen & 1];    // the other job may still be read by a late worker; its claims then fail
    const int64_t unit = (n + MAX_UNITS - 1) / MAX_UNITS, units = (n + unit - 1) / unit;
    job.fn.store(fn, std::memory_order_relaxed);
    job.ctx.store(ctx, std::memory_order_relaxed);
    job.n.store(n, std::memory_order_relaxed);
    job.unit.store(unit, std::memory_order_relaxed);
    job.units.store(units, std::memory_order_relaxed);
    job.threads.store(threads, std::memory_order_relaxed);
    job.done.store(0, std::memory_order_relaxed);
    job.caller_asleep.store(false, std::memory_order_relaxed);
    for (int r = 0; r < threads; ++r)  // the static schedule's ranges
      ranges_[r].word.store(pack(gen, units * r / threads, units * (r + 1) / threads), std::memory_order_relaxed);
    loop_.store(gen);  // publishes the job (seq_cst: ordered before the sleepers check)
    wake_.fetch_add(1);
    if (sleepers_.load() > 0) futex_wake_all(&wake_);
    stats.loops.fetch_add(1, std::memory_order_relaxed);
    const int64_t mine = work(gen, job, 0);
    count_done(job, mine);
    stats.caller_items.fetch_add(mine, std::memory_order_relaxed);
    const auto finished = [&] { return job.done.load(std::memory_order_acquire) == units; };
    while (!spin_until(finished, spin_us.load(std::memory_order_relaxed))) {
      job.caller_asleep.store(true);  // seq_cst against the worker's done update and its check of this flag
      const uint32_t seen = job.done.load();
      if (seen == units) break;
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
    uint32_t seen = loop_.load();
    for (;;) {
      const auto fresh = [&] { return loop_.load(std::memory_order_acquire) != seen; };
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
      seen = loop_.load(std::memory_order_acquire);
      if (const int64_t delay = worker_delay_us.load(std::memory_order_relaxed))
        std::this_thread::sleep_for(std::chrono::microseconds(delay));
      Job& job = jobs_[seen & 1];
      // participant id + 1 (the caller is 0), if this loop has one; a stale read only makes its claims fail
      if (id + 1 >= job.threads.load(std::memory_order_relaxed)) continue;
      const int64_t mine = work(seen, job, id + 1);
      count_done(job, mine);
      stats.worker_items.fetch_add(mine, std::memory_order_relaxed);
    }
  }

  std::mutex caller_;                   // one loop on the pool at a time; other callers run theirs inline
  uint32_t gen_ = 0;                    // the last loop's generation (caller only)
  Job jobs_[2];                         // by generation parity
  Range ranges_[MAX_THREADS];           // each participant's range of the current loop
  alignas(64) std::atomic<uint32_t> loop_{0};  // the generation of the loop published last
  std::atomic<uint32_t> wake_{0};              // bumped at every loop: the futex word sleeping workers wait on
  std::atomic<int> sleepers_{0};
  alignas(64) std::atomic<int> started_{0};
};

}  // namespace pool
