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
//
// Programs (run_program): a sequence of stages, each a serial part and a parallel job, that ANY of our threads
// carries forward. With the caller as the only thread that could start the next job, a decode step advanced only
// while the caller ran: beside one busy process per core it had half a core, and the worker's help counted only
// in the quarter of the time both ran, so 2 threads decoded slower than 1 (which the scheduler gives two thirds of
// a core). In a program the thread that completes a stage's last chunk runs the next serial part and publishes the
// next job, whichever thread it is; a thread that finds a job's chunks all taken and one still outstanding after a
// few chunk-times computes that chunk too (its holder was preempted), and the first to finish publishes it. So the
// step moves whenever one of our threads runs. What makes a late thread harmless:
//  - every chunk of a program job is computed into the thread's own scratch and published by compare-exchanging
//    the chunk's state (tagged with the job's 64-bit number) to COMMITTING, then copied: one copy per chunk ever
//    reaches the outputs, never after its job is over. Which thread computed it never changes the bits;
//  - a job's closure is copied into the pool by value and read under a sequence lock (or proved current by a
//    successful claim), so nobody reads a frame that is gone or a job's fields half rewritten;
//  - a late thread still reads the job's inputs: the program's owner keeps them alive until run_program returns,
//    and run_program returns only once no worker is inside a chunk (`computing_`, set before and checked against
//    the program's end the way the end is set before the flags are read: one of the two always sees the other).
#pragma once

#include <stdint.h>
#include <string.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <type_traits>
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

// ---- program jobs ----
// a chunk still outstanding this long after the last was claimed is computed again by a thread with nothing to do
// (three of its own chunk-times if longer): a preempted holder is gone for a time slice, milliseconds; a running
// one is late by microseconds
constexpr auto REDO_AFTER = std::chrono::microseconds(100);
// a job a worker completed waits this long for the caller to run the next serial part (on the core whose caches
// hold the step's activations; quiet bf16 decode read 0.93x of the old pool with serial parts on whichever thread
// finished last, 1.00x with this hand-off and one-chunk jobs run inline) before the worker runs it itself
constexpr auto HANDOFF = std::chrono::microseconds(50);
// ... unless the caller's loop has not turned for this long: it is not running (preempted), so waiting for it
// would cost every stage of the step until it returns
constexpr auto CALLER_GONE = std::chrono::microseconds(5);
// a thread waiting inside a program (for a serial part, a copy, a preempted holder) spins this long, then yields
constexpr auto PROGRAM_SPIN = std::chrono::microseconds(200);
constexpr int64_t MAX_JOB_CHUNKS = 1024;     // chunk states kept (larger chunks beyond)
constexpr int CLOSURE_WORDS = 32;            // a job's closure, copied by value: at most 256 bytes
// a chunk's state: (job number << 2) | one of these; an older job number: not yet published
enum : uint64_t { ST_COMMITTING = 1, ST_DONE = 2 };
// op 0: floats of scratch chunk [b, e) needs; 1: compute it into `buf` (nullptr: the real outputs); 2: copy `buf`
// into the real outputs
using job_fn = size_t (*)(const void* closure, int op, int64_t b, int64_t e, float* buf);

// A stage's parallel part: F (trivially copyable, at most 256 bytes) with
//   size_t scratch(b, e) const                 floats chunk [b, e)'s outputs take
//   void compute(b, e, float* to) const        to: nullptr (the real outputs) or scratch of scratch(b, e) floats
//   void commit(b, e, const float* from) const scratch -> the real outputs
// and the same bits whichever way a chunk is computed. items == 0: the stage has none.
struct Job {
    job_fn fn = nullptr;
    uint64_t words[CLOSURE_WORDS];
    int64_t items = 0, chunk = 1;

    template <typename F>
    void set(const F& f, int64_t n, int64_t c) {
        static_assert(std::is_trivially_copyable<F>::value && sizeof(F) <= sizeof(words), "closure too large");
        memcpy(words, &f, sizeof(F));
        items = n, chunk = c < 1 ? 1 : c;
        fn = [](const void* w, int op, int64_t b, int64_t e, float* buf) -> size_t {
            alignas(F) unsigned char bytes[sizeof(F)];   // the closure's bytes, aligned for F
            memcpy(bytes, w, sizeof(F));
            const F& fc = *reinterpret_cast<const F*>(bytes);
            if (op == 0) return fc.scratch(b, e);
            if (op == 1) fc.compute(b, e, buf);
            else fc.commit(b, e, buf);
            return 0;
        };
    }
    void run_inline() const {
        if (items > 0) fn(words, 1, 0, items, nullptr);
    }
};

// a program: stage s's serial part runs, and its job is filled in; false once s is past the last stage
using stage_fn = bool (*)(void* prog, int64_t s, Job* job);

static std::atomic<uint64_t>& redone_count() {
    static std::atomic<uint64_t> n{0};
    return n;
}

class Pool {
   public:
    explicit Pool(int workers) : cpus_(workers), computing_(workers) {
        for (auto& c : cpus_) c.store(-1, std::memory_order_relaxed);
        for (auto& c : computing_) c.store(0, std::memory_order_relaxed);
        for (auto& s : st_) s.store(0, std::memory_order_relaxed);
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
        jfn_.store(nullptr, std::memory_order_relaxed);
        ctx_.store(ctx, std::memory_order_relaxed);
        items_.store(items, std::memory_order_relaxed);
        chunk_.store(chunk, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        const uint32_t g = publish(n);
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

    // run a program (see the top) on the caller and the workers; returns when its last stage is done and no worker
    // is inside one of its chunks
    void run_program(stage_fn stage, void* prog, std::vector<float>& scratch) {
        pfn_.store(stage, std::memory_order_relaxed);
        prog_.store(prog, std::memory_order_relaxed);
        stage_.store(-1, std::memory_order_relaxed);
        const uint64_t P = prog_no_.load(std::memory_order_relaxed) + 1;
        prog_no_.store(P, std::memory_order_seq_cst);
        advance();
        participate(-1, scratch, P);
        for (size_t i = 0; i < computing_.size(); ++i)
            for (int spin = 0; computing_[i].load(std::memory_order_seq_cst); ++spin) {
                if ((spin & 63) == 63) sched_yield();
                else cpu_relax();
            }
    }

   private:
    uint32_t publish(int64_t n) {
        const uint32_t g = gen_.load(std::memory_order_relaxed) + 1;
        gen_.store(g, std::memory_order_relaxed);
        ticket_.store((uint64_t)g << 32 | (uint64_t)n << 16, std::memory_order_seq_cst);   // publish (release: the fields)
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            std::lock_guard<std::mutex> lk(m_);
            cv_.notify_all();
        }
        return g;
    }

    // after the program's current job completed (or at its start): run the following stages' serial parts up to
    // the next one with a job, and publish that job; or end the program. One thread at a time: the one whose
    // publication completed the job.
    void advance() {
        const stage_fn stage = pfn_.load(std::memory_order_relaxed);
        void* prog = prog_.load(std::memory_order_relaxed);
        int64_t s = stage_.load(std::memory_order_relaxed);
        Job job;
        for (;;) {
            if (!stage(prog, ++s, &job)) {
                over_.store(prog_no_.load(std::memory_order_relaxed), std::memory_order_seq_cst);
                return;
            }
            if (job.items > job.chunk) break;
            job.run_inline();   // one chunk: a serial part like the rest (nobody else could help)
        }
        stage_.store(s, std::memory_order_relaxed);
        int64_t chunk = job.chunk;
        if ((job.items + chunk - 1) / chunk > MAX_JOB_CHUNKS) chunk = (job.items + MAX_JOB_CHUNKS - 1) / MAX_JOB_CHUNKS;
        const int64_t n = (job.items + chunk - 1) / chunk;
        seq_.fetch_add(1, std::memory_order_seq_cst);   // odd: the fields are being rewritten
        for (int i = 0; i < CLOSURE_WORDS; ++i) words_[i].store(job.words[i], std::memory_order_relaxed);
        jfn_.store(job.fn, std::memory_order_relaxed);
        items_.store(job.items, std::memory_order_relaxed);
        chunk_.store(chunk, std::memory_order_relaxed);
        job64_.store(job64_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
        jn_.store(n, std::memory_order_relaxed);
        jgen_.store(gen_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);   // what publish() takes
        done_.store(0, std::memory_order_relaxed);
        seq_.fetch_add(1, std::memory_order_release);
        publish(n);
    }

    // a program job's fields as one participant sees them
    struct View {
        job_fn fn;
        uint64_t words[CLOSURE_WORDS];
        uint64_t j;
        uint32_t g;   // the ticket generation these fields were published under
        int64_t items, chunk, n;
        int64_t bounds(int64_t k, int64_t& e) const {
            e = (k + 1) * chunk < items ? (k + 1) * chunk : items;
            return k * chunk;
        }
    };
    void read_fields(View& v) const {
        for (int i = 0; i < CLOSURE_WORDS; ++i) v.words[i] = words_[i].load(std::memory_order_relaxed);
        v.fn = jfn_.load(std::memory_order_relaxed);
        v.j = job64_.load(std::memory_order_relaxed);
        v.items = items_.load(std::memory_order_relaxed);
        v.chunk = chunk_.load(std::memory_order_relaxed);
        v.n = jn_.load(std::memory_order_relaxed);
        v.g = jgen_.load(std::memory_order_relaxed);
    }

    // chunk k of job v into scratch, published unless another thread published it first; the last publication of
    // a job advances the program. Returns whether this copy was the one published.
    bool run_chunk(const View& v, int64_t k, std::vector<float>& scratch, int slot) {
        int64_t e;
        const int64_t b = v.bounds(k, e);
        const size_t need = v.fn(v.words, 0, b, e, nullptr);
        if (scratch.size() < need) scratch.resize(need);
        v.fn(v.words, 1, b, e, scratch.data());
        uint64_t st = st_[k].load(std::memory_order_acquire);
        bool won = false;
        while (!won && (st >> 2) < v.j)
            won = st_[k].compare_exchange_weak(st, v.j << 2 | ST_COMMITTING, std::memory_order_acq_rel,
                                               std::memory_order_acquire);
        if (!won) return false;
        v.fn(v.words, 2, b, e, scratch.data());
        st_[k].store(v.j << 2 | ST_DONE, std::memory_order_release);
        if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == v.n) {
            if (slot < 0) advance();
            else ready_.store(v.j, std::memory_order_release);   // the caller's to advance (HANDOFF)
        }
        return true;
    }

    // take part in program P until it is over: claim chunks, advance it, compute a late holder's chunk again
    void participate(int slot, std::vector<float>& scratch, uint64_t P) {
        std::atomic<int> none{0};
        std::atomic<int>& busy = slot >= 0 ? computing_[slot] : none;
        uint32_t stuck_g = 0;
        uint64_t seen_ready = 0, beats = 0, seen_beat = 0;
        clock::time_point since{}, redo_at{}, ready_at{}, beat_at = clock::now();
        clock::duration per{};
        const auto redo_wait = [&] { return 3 * per > REDO_AFTER ? 3 * per : clock::duration(REDO_AFTER); };
        for (int spin = 0;; ++spin) {
            busy.store(1, std::memory_order_seq_cst);   // before anything of the program is touched (see the top)
            if (over_.load(std::memory_order_seq_cst) >= P) break;
            if (slot < 0) {
                beat_.store(++beats, std::memory_order_relaxed);   // the caller is running
            } else {
                const uint64_t b = beat_.load(std::memory_order_relaxed);
                if (b != seen_beat) seen_beat = b, beat_at = clock::now();
            }
            uint64_t r = ready_.load(std::memory_order_acquire);
            if (r) {   // a completed job whose next serial part nobody runs yet: the caller at once, others later
                const auto now = clock::now();
                if (r != seen_ready) seen_ready = r, ready_at = now + HANDOFF;
                if ((slot < 0 || now > ready_at || now - beat_at > CALLER_GONE) &&
                    ready_.compare_exchange_strong(r, 0, std::memory_order_acq_rel)) {
                    advance();
                    spin = 0;
                    continue;
                }
            }
            const uint64_t t = ticket_.load(std::memory_order_acquire);
            const uint32_t g = (uint32_t)(t >> 32);
            View v;
            int64_t k;
            // the fields are read only when there is a chunk to claim (a spinning reader slows their writer)
            if ((t & 0xFFFF) < ((t >> 16) & 0xFFFF) && (read_fields(v), v.fn && v.g == g) && claim(g, k)) {
                // a successful claim proves the fields read above are job g's
                const auto t0 = clock::now();
                run_chunk(v, k, scratch, slot);
                per = clock::now() - t0;
                stuck_g = 0, spin = 0;
                continue;
            }
            busy.store(0, std::memory_order_release);
            const auto now = clock::now();
            if (g != stuck_g) {   // this job's chunks are all taken: wait a little before doing one again
                stuck_g = g, since = now;
                redo_at = now + redo_wait();
            } else if (now > redo_at && redo(g, scratch, busy, P, slot)) {
                redo_at = clock::now() + redo_wait();
                spin = 0;
                continue;
            }
            if ((spin & 63) == 63 && now - since > PROGRAM_SPIN) sched_yield();
            else cpu_relax();
        }
        busy.store(0, std::memory_order_release);
    }

    // compute again one chunk of job g that is taken but not published; false when there is none (or the job
    // moved on). Its fields are read under the sequence lock (no claim proves them here), and must be g's: the
    // ticket may still show g when the fields already are the next job's.
    bool redo(uint32_t g, std::vector<float>& scratch, std::atomic<int>& busy, uint64_t P, int slot) {
        busy.store(1, std::memory_order_seq_cst);
        bool did = false;
        if (over_.load(std::memory_order_seq_cst) < P) {
            View v;
            const uint32_t s1 = seq_.load(std::memory_order_acquire);
            read_fields(v);
            std::atomic_thread_fence(std::memory_order_acquire);
            if (!(s1 & 1) && seq_.load(std::memory_order_relaxed) == s1 && v.g == g && v.fn) {
                for (int64_t k = 0; k < v.n && !did; ++k) {
                    if ((st_[k].load(std::memory_order_acquire) >> 2) >= v.j) continue;   // published (or being)
                    did = true;
                    redone_count().fetch_add(1, std::memory_order_relaxed);
                    run_chunk(v, k, scratch, slot);
                }
            }
        }
        busy.store(0, std::memory_order_release);
        return did;
    }

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
        std::vector<float> scratch;   // a program chunk's outputs, until published
        uint32_t seen = current();
        for (;;) {
            seen = await(seen);
            if (stop_.load(std::memory_order_relaxed)) return;
            // a live program: take part until it ends (its jobs come and go); then back to waiting on whatever
            // generation came last (a job published meanwhile is then found at once)
            const uint64_t P = prog_no_.load(std::memory_order_seq_cst);
            if (over_.load(std::memory_order_seq_cst) < P) participate(slot, scratch, P);
            else work(seen, slot);
        }
    }

    alignas(64) std::atomic<uint64_t> ticket_{0};
    alignas(64) std::atomic<int64_t> done_{0};
    alignas(64) std::atomic<task_fn> fn_{nullptr};
    std::atomic<const void*> ctx_{nullptr};
    std::atomic<int64_t> items_{0}, chunk_{1};
    std::atomic<uint32_t> gen_{0};   // the publisher's (the caller; in a program, whoever advances it)
    // a program and its current job
    std::atomic<stage_fn> pfn_{nullptr};
    std::atomic<void*> prog_{nullptr};
    std::atomic<int64_t> stage_{-1};
    alignas(64) std::atomic<uint64_t> prog_no_{0}, over_{0};   // the latest program's number; the latest ended
    alignas(64) std::atomic<uint64_t> ready_{0};   // a job completed by a worker, not yet advanced (HANDOFF)
    alignas(64) std::atomic<uint64_t> beat_{0};    // turns of the caller's loop (CALLER_GONE)
    std::atomic<job_fn> jfn_{nullptr};             // the current job's (null: an ordinary job)
    std::atomic<uint64_t> words_[CLOSURE_WORDS];
    std::atomic<uint64_t> job64_{0};               // the current job's number (chunk states are tagged with it)
    alignas(64) std::atomic<int64_t> jn_{0};                   // its chunk count
    std::atomic<uint32_t> jgen_{0};                // the generation it is published under
    std::atomic<uint32_t> seq_{0};                 // odd while the job's fields are rewritten
    alignas(64) std::atomic<uint64_t> st_[MAX_JOB_CHUNKS];
    std::vector<std::atomic<int>> computing_;      // per worker: inside a program's chunk (or about to be)
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

// chunk size for `items` equal items on `nthreads` threads: about 8 chunks per thread, so a late thread costs an
// eighth of its share, and at least `min_chunk` items so that claiming stays negligible
static inline int64_t chunk_for(int64_t items, int nthreads, int64_t min_chunk = 1) {
    int64_t c = items / ((int64_t)(nthreads > 1 ? nthreads : 1) * 8);
    return c < min_chunk ? min_chunk : c;
}

// the pool, sized for nthreads, now held by this caller; null when another dispatch holds it (run inline then)
static Pool* acquire(int nthreads) {
    Holder& h = holder();
    bool expect = false;
    if (!h.busy.compare_exchange_strong(expect, true, std::memory_order_acquire)) return nullptr;
    if (h.pool == nullptr || h.pool->workers() != nthreads - 1) {
        if (h.pool) {
            h.pool->stop();
            delete h.pool;
        }
        h.pool = new Pool(nthreads - 1);
    }
    return h.pool;
}

static void release() { holder().busy.store(false, std::memory_order_release); }

// run f(begin, end) over [0, items) in chunks on up to `nthreads` threads; inline (one chunk loop on the caller)
// for one thread, one chunk, or when another dispatch is running (a nested call or a second calling thread: the
// result is the same, only slower)
template <typename F>
static void run(int nthreads, int64_t items, int64_t chunk, const F& f) {
    if (items <= 0) return;
    if (chunk < 1) chunk = 1;
    Pool* p = nthreads <= 1 || items <= chunk ? nullptr : acquire(nthreads);
    if (!p) {
        f((int64_t)0, items);
        return;
    }
    p->dispatch([](const void* ctx, int64_t b, int64_t e) { (*(const F*)ctx)(b, e); }, &f, items, chunk);
    release();
}

// run a program (see the top) on up to `nthreads` threads; inline, stage after stage, on one thread or when the
// pool is held by another dispatch. Everything its stages read must stay alive until this returns.
static void run_program(int nthreads, stage_fn stage, void* prog) {
    Pool* p = nthreads <= 1 ? nullptr : acquire(nthreads);
    if (!p) {
        Job job;
        for (int64_t s = 0; stage(prog, s, &job); ++s) job.run_inline();
        return;
    }
    static thread_local std::vector<float> scratch;
    p->run_program(stage, prog, scratch);
    release();
}

// chunks computed again because their holder was late, in this process (tests: that the path ran)
static inline uint64_t redone() { return redone_count().load(std::memory_order_relaxed); }

// how a kernel's job is run: now, as an ordinary dispatch (a kernel called on its own), or later, as a program's
// stage (Later fills the stage's Job)
struct Now {
    int nthreads;
    template <typename F>
    void operator()(const F& f, int64_t items, int64_t min_chunk = 1) const {
        run(nthreads, items, chunk_for(items, nthreads, min_chunk),
            [&](int64_t b, int64_t e) { f.compute(b, e, nullptr); });
    }
};
struct Later {
    Job* job;
    int nthreads;
    template <typename F>
    void operator()(const F& f, int64_t items, int64_t min_chunk = 1) const {
        job->set(f, items, chunk_for(items, nthreads, min_chunk));
    }
};

}  // namespace pool
