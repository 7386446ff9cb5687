// The row kernels' thread pool: work is claimed, not assigned, so a thread another process has preempted costs
// only the chunk it holds, never the whole step.
//
// Why not OpenMP: an `omp parallel for` region ends at a barrier that waits for every thread of the team, including
// one that has not even been scheduled yet; a decode step passes ~100 such barriers, so beside one busy process
// per core a 2-thread decode fell to 0.25 tok/s (1 thread: 4.8; quiet: ~50). Here a dispatch publishes a job; the
// caller and any worker that is awake claim chunks of it until none are left; the caller then waits only for
// chunks that were claimed and are still running. A worker that wakes after the job's chunks are gone does
// nothing. Which thread computes a chunk never changes its bits: every item is computed by the same code alone.
//
// Safety of a late worker (the one subtle point). `ticket_` packs (generation << 32 | chunk count << 16 | next
// chunk) in one 64-bit atomic; a chunk is claimed by a compare-exchange from (g, n, k) to (g, n, k + 1), and only
// while k < n -- the count read from the same value the exchange checks. So a successful claim of (g, n, k) proves
// job g is unfinished (its chunk k was not yet claimed) and its fields are still g's. (The count once lived in a
// field of its own: a worker that read the ticket (g, k = n) after the last claim, then the NEXT job's larger
// count, claimed a phantom chunk k of g before the caller published g + 1, ran it on a mix of two jobs' fields and
// counted it in the next job's done_; `specscope serve` once hung on it.) A worker holding a stale generation fails
// the compare-exchange and never touches the next job with the last job's pointers. The fields are relaxed
// atomics, so reading them while the caller rewrites them for the next job (a worker about to find nothing left)
// is a harmless race, not undefined behaviour. `done_` is reset before the next publish, and only after it reached
// the count: no increment of an old job can land on a new one.
#pragma once

#include <stdint.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <sched.h>

#if defined(__linux__)
static inline int this_cpu() { return sched_getcpu(); }
#else
static inline int this_cpu() { return -1; }   // unknown: never taken for the caller's own
#endif

namespace pool {

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
}

using clock = std::chrono::steady_clock;
using task_fn = void (*)(const void* ctx, int64_t begin, int64_t end);

// how long an idle worker spins (pause), then yields its CPU, before it sleeps; and how long the caller spins on
// in-flight chunks before it yields. A chunk still in flight at the end is usually held by a worker another process
// preempted on ANOTHER core: yielding then hands our own core to our own neighbour for a whole time slice and the
// step waits twice, so the caller spins through a typical slice (beside one busy process per core, 2-thread bf16
// decode went from 0.95x to 1.07x of 1-thread over four runs each, bench/shared_machine.py). Only when a worker
// in flight last ran on the caller's own CPU does the caller yield at once: spinning there keeps it off the CPU.
constexpr auto SPIN = std::chrono::microseconds(50);
constexpr auto YIELD = std::chrono::microseconds(2000);
constexpr auto CALLER_SPIN = std::chrono::microseconds(3000);
constexpr int64_t MAX_CHUNKS = 0xFFFF;    // a job's chunk count lives in 16 bits of the ticket (larger chunks beyond)

class Pool {
   public:
    explicit Pool(int workers) : cpus_(workers) {
        for (auto& c : cpus_) c.store(-1, std::memory_order_relaxed);
        for (int i = 0; i < workers; ++i) threads_.emplace_back([this, i] { worker(i); });
    }

    int workers() const { return (int)threads_.size(); }

    // stop and join every worker (resizing, never at exit: the process-wide pool is never destroyed)
    void stop() {
        {
            std::lock_guard<std::mutex> lk(m_);
            stop_.store(true, std::memory_order_seq_cst);
            cv_.notify_all();
        }
        for (auto& t : threads_) t.join();
        threads_.clear();
    }

    // run fn over [0, items) in chunks of `chunk` items on the caller and the workers; returns when every chunk is
    // done. One dispatch at a time (the caller holds the pool: see run()).
    void dispatch(task_fn fn, const void* ctx, int64_t items, int64_t chunk) {
        if ((items + chunk - 1) / chunk > MAX_CHUNKS) chunk = (items + MAX_CHUNKS - 1) / MAX_CHUNKS;
        const int64_t n = (items + chunk - 1) / chunk;
        fn_.store(fn, std::memory_order_relaxed);
        ctx_.store(ctx, std::memory_order_relaxed);
        items_.store(items, std::memory_order_relaxed);
        chunk_.store(chunk, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        const uint32_t g = ++gen_;
        ticket_.store((uint64_t)g << 32 | (uint64_t)n << 16, std::memory_order_seq_cst);   // publish (release: the fields)
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            std::lock_guard<std::mutex> lk(m_);
            cv_.notify_all();
        }
        work(g, -1);
        // only chunks someone claimed can be outstanding: spin through a preemption elsewhere, yield to a holder
        // on our own CPU (see CALLER_SPIN)
        if (done_.load(std::memory_order_acquire) == n) return;
        const auto until = clock::now() + (holder_here() ? std::chrono::microseconds(0) : CALLER_SPIN);
        for (int i = 0; done_.load(std::memory_order_acquire) != n; ++i) {
            if ((i & 63) == 0 && clock::now() > until) sched_yield();
            else cpu_relax();
        }
    }

   private:
    // claim chunk k of generation g; false once g has no chunk left (or is over)
    bool claim(uint32_t g, int64_t& k) {
        uint64_t t = ticket_.load(std::memory_order_acquire);
        for (;;) {
            if ((uint32_t)(t >> 32) != g) return false;
            const uint32_t next = (uint32_t)(t & 0xFFFF);
            if ((t & 0xFFFF) >= ((t >> 16) & 0xFFFF)) return false;      // no chunk left (the count is g's own)
            if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
                k = next;
                return true;
            }
        }
    }

    // whether a worker in a job right now last ran on the caller's CPU
    bool holder_here() const {
        const int me = this_cpu();
        if (me < 0) return false;
        for (const auto& c : cpus_)
            if (c.load(std::memory_order_relaxed) == me) return true;
        return false;
    }

    // claim and run chunks of job g; `slot`: the worker's index (its CPU is published while it works), -1 the caller
    void work(uint32_t g, int slot) {
        int64_t k;
        if (slot >= 0) cpus_[slot].store(this_cpu(), std::memory_order_relaxed);
        while (claim(g, k)) {
            const int64_t chunk = chunk_.load(std::memory_order_relaxed), items = items_.load(std::memory_order_relaxed);
            const int64_t b = k * chunk, e = b + chunk < items ? b + chunk : items;
            fn_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), b, e);
            done_.fetch_add(1, std::memory_order_release);
        }
        if (slot >= 0) cpus_[slot].store(-1, std::memory_order_relaxed);
    }

    uint32_t current() const { return (uint32_t)(ticket_.load(std::memory_order_acquire) >> 32); }

    // wait for a generation other than `seen` (or stop): spin, then yield, then sleep
    uint32_t await(uint32_t seen) {
        const auto t0 = clock::now();
        for (int i = 0;; ++i) {
            uint32_t g = current();
            if (g != seen || stop_.load(std::memory_order_relaxed)) return g;
            if ((i & 63) != 0) {
                cpu_relax();
                continue;
            }
            const auto waited = clock::now() - t0;
            if (waited < SPIN) continue;
            if (waited < YIELD) {
                sched_yield();
                continue;
            }
            // sleepers_ then the ticket here, the ticket then sleepers_ in dispatch (all seq_cst): either the
            // dispatcher sees us and notifies under the lock, or we see its generation in the predicate
            sleepers_.fetch_add(1, std::memory_order_seq_cst);
            {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [&] { return current() != seen || stop_.load(std::memory_order_seq_cst); });
            }
            sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
    }

    void worker(int slot) {
        uint32_t seen = current();
        for (;;) {
            seen = await(seen);
            if (stop_.load(std::memory_order_relaxed)) return;
            work(seen, slot);
        }
    }

    alignas(64) std::atomic<uint64_t> ticket_{0};
    alignas(64) std::atomic<int64_t> done_{0};
    alignas(64) std::atomic<task_fn> fn_{nullptr};
    std::atomic<const void*> ctx_{nullptr};
    std::atomic<int64_t> items_{0}, chunk_{1};
    uint32_t gen_ = 0;   // the caller's alone
    std::atomic<int> sleepers_{0};
    std::vector<std::atomic<int>> cpus_;    // per worker: the CPU it runs a job on, -1 between jobs
    std::atomic<bool> stop_{false};
    std::mutex m_;
    std::condition_variable cv_;
    std::vector<std::thread> threads_;
};

// The process's pool, sized for `nthreads` (the caller counts as one), made or resized at first need. Never
// destroyed: at exit its threads simply end with the process. A forked child inherits the pool without its
// threads, so it abandons it (pthread_atfork) and makes its own at its first dispatch.
struct Holder {
    std::atomic<bool> busy{false};
    Pool* pool = nullptr;
};

static Holder& holder() {
    static Holder* h = [] {
        pthread_atfork(nullptr, nullptr, [] {
            Holder& c = holder();
            c.pool = nullptr;
            c.busy.store(false, std::memory_order_relaxed);
        });
        return new Holder();
    }();
    return *h;
}

// run f(begin, end) over [0, items) in chunks on up to `nthreads` threads; inline (one chunk loop on the caller)
// for one thread, one chunk, or when another dispatch is running (a nested call or a second calling thread: the
// result is the same, only slower)
template <typename F>
static void run(int nthreads, int64_t items, int64_t chunk, const F& f) {
    if (items <= 0) return;
    if (chunk < 1) chunk = 1;
    Holder& h = holder();
    bool expect = false;
    if (nthreads <= 1 || items <= chunk || !h.busy.compare_exchange_strong(expect, true, std::memory_order_acquire)) {
        f((int64_t)0, items);
        return;
    }
    if (h.pool == nullptr || h.pool->workers() != nthreads - 1) {
        if (h.pool) {
            h.pool->stop();
            delete h.pool;
        }
        h.pool = new Pool(nthreads - 1);
    }
    h.pool->dispatch([](const void* ctx, int64_t b, int64_t e) { (*(const F*)ctx)(b, e); }, &f, items, chunk);
    h.busy.store(false, std::memory_order_release);
}

// chunk size for `items` equal items on `nthreads` threads: about 8 chunks per thread, so a late thread costs an
// eighth of its share, and at least `min_chunk` items so that claiming stays negligible
static inline int64_t chunk_for(int64_t items, int nthreads, int64_t min_chunk = 1) {
    int64_t c = items / ((int64_t)(nthreads > 1 ? nthreads : 1) * 8);
    return c < min_chunk ? min_chunk : c;
}

}  // namespace pool
