// The thread pool the engine's C++ kernels split their work over (kvstream::parallel_for).
//
// Why not at::parallel_for: in torch's CPU builds it is inline OpenMP, and a decode step calls
// the kernels ~200 times for ~0.05-0.3 ms each, so what a parallel region costs to start
// matters. libgomp's workers spin between regions only while the process has no more
// OpenMP-managed threads than CPUs; once a second thread has run a parallel region (the
// server loads the model on one thread and runs the engine on another; a library user's
// own torch work on the main thread does the same), every worker sleeps on a futex between
// regions and each call pays a wake-up: measured here, the linear kernel lost all of its 1.3x
// at batch 1 when the engine ran on a thread of its own.
//
// This pool keeps torch.get_num_threads() - 1 workers of its own that spin for up to
// kSpin after each job (the gap between two kernel calls in a forward is far shorter) and
// then sleep on a condition variable; the calling thread runs the first share. Work is split
// into contiguous ranges, one per thread, as at::parallel_for splits it. One caller at a time:
// a second thread calling in meanwhile (or a nested call) runs its loop on its own, serially.
// Each extension that includes this header has its own pool (they do not run at once).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#ifdef _WIN32
#include <process.h>
#define KVSTREAM_PID() _getpid()
#else
#include <unistd.h>
#define KVSTREAM_PID() getpid()
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVSTREAM_PAUSE() _mm_pause()
#else
#define KVSTREAM_PAUSE() std::this_thread::yield()
#endif

namespace kvstream {

class SpinPool {
  public:
    static SpinPool& instance() {
        static SpinPool* pool = new SpinPool();  // never destroyed: its workers live as long as the process
        return *pool;
    }

    // fn(begin, end) over [begin, end) split in up to torch.get_num_threads() contiguous ranges
    // of at least ``grain`` items; returns once every range is done; rethrows the first
    // exception a range threw.
    void run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
        const int64_t n = end - begin;
        if (n <= 0) return;
        const int64_t chunks = (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
        const int threads = static_cast<int>(std::min<int64_t>(std::max(at::get_num_threads(), 1), chunks));
        std::unique_lock<std::mutex> caller(call_, std::try_to_lock);
        if (threads == 1 || !caller.owns_lock()) {  // nothing to split, or the pool is busy
            fn(begin, end);
            return;
        }
        grow(threads - 1);
        begin_ = begin;
        size_ = n;
        threads_ = threads;
        job_ = &fn;
        error_ = nullptr;
        // Every worker answers every job, its share empty past ``threads``: none can still be
        // looking at this job's fields when the next one writes them.
        remaining_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lock(sleep_);
            generation_.fetch_add(1, std::memory_order_release);
        }
        wake_.notify_all();
        share(0);
        while (remaining_.load(std::memory_order_acquire) > 0) KVSTREAM_PAUSE();
        job_ = nullptr;
        if (error_) std::rethrow_exception(error_);
    }

    // Workers running (the test of the build uses it).
    int workers() const { return static_cast<int>(workers_.size()); }

  private:
    static constexpr std::chrono::microseconds kSpin{1000};

    void share(int index) {
        const int64_t lo = begin_ + size_ * index / threads_, hi = begin_ + size_ * (index + 1) / threads_;
        if (lo >= hi) return;
        try {
            (*job_)(lo, hi);
        } catch (...) {
            std::lock_guard<std::mutex> lock(sleep_);
            if (!error_) error_ = std::current_exception();
        }
    }

    void grow(int wanted) {
        if (owner_ != KVSTREAM_PID()) {  // a forked child: the parent's workers are not here
            workers_.clear();
            owner_ = KVSTREAM_PID();
        }
        while (static_cast<int>(workers_.size()) < wanted) {
            const int index = static_cast<int>(workers_.size()) + 1;
            // The generation before this job's: a worker that starts after the job is
            // posted must still see it as new.
            const uint64_t before = generation_.load(std::memory_order_acquire);
            workers_.emplace_back([this, index, before] { work(index, before); });
            workers_.back().detach();
        }
    }

    void work(int index, uint64_t seen) {
        for (;;) {
            auto spin_until = std::chrono::steady_clock::now() + kSpin;
            uint64_t now;
            int spins = 0;
            while ((now = generation_.load(std::memory_order_acquire)) == seen) {
                KVSTREAM_PAUSE();
                if (++spins % 256 == 0 && std::chrono::steady_clock::now() > spin_until) {
                    std::unique_lock<std::mutex> lock(sleep_);
                    wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
                }
            }
            seen = now;
            if (index < threads_) share(index);
            remaining_.fetch_sub(1, std::memory_order_release);
        }
    }

    std::mutex call_;   // one caller at a time
    std::mutex sleep_;  // guards sleeping workers' wake-up (and the first error)
    std::condition_variable wake_;
    std::atomic<uint64_t> generation_{0};  // bumped once per job
    std::atomic<int> remaining_{0};        // workers not yet done with the current job
    std::vector<std::thread> workers_;
    const std::function<void(int64_t, int64_t)>* job_ = nullptr;
    int64_t begin_ = 0, size_ = 0;
    int threads_ = 1;
    std::exception_ptr error_;
    pid_t owner_ = KVSTREAM_PID();
};

// at::parallel_for's contract, run on SpinPool.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
    SpinPool::instance().run(begin, end, grain, std::function<void(int64_t, int64_t)>(fn));
}

}  // namespace kvstream
