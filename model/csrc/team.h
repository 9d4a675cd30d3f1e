// A team: torch's threads held in one parallel region for a whole decode step (decode_step.cpp), meeting at
// barriers between its matrix products instead of each product opening and closing a region of its own.
//
// Why: a decode step of a small model is ~150 products of 20-120 us each, and a parallel region costs ~8 us
// to open and close on 2 threads when the other thread has to be woken (libgomp's default: it spins a
// while, then sleeps) and ~30 us where it sleeps at once (OMP_WAIT_POLICY=PASSIVE), while the serial work
// between products (norms, RoPE, the residual, SwiGLU) left the other threads waiting (docs/benchmarks.md).
// In a team every member runs the same step's code: each keeps its own copy of what is cheap to compute
// (the residual stream, a norm's output, x rounded for the kernel), splits the rest (a product's rows, the
// attention's tasks, SwiGLU's values) and waits at a barrier where a result is read by others. Which member
// computes what never changes a value: a product's row and an attention task are computed the same way by
// any thread, so a step gives the same bits with one thread, a team, or torch's regions.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#endif

namespace llama {

class Team;

// The calling thread's team and its place in it, while it runs a team's work (else team is null).
struct Member {
  Team* team = nullptr;
  int64_t me = 0;
};
inline thread_local Member t_member;

// A task queue for one parallel loop (parallel_rows in matvec.cpp): a thread's tasks still to take,
// [first, end), as first << 32 | end, one cache line each.
struct alignas(64) Share {
  std::atomic<uint64_t> tasks{0};
};

class Team {
 public:
  // Teams that gathered and ran, since the library loaded (tests check that one did).
  static inline std::atomic<int64_t> steps_run{0};

  explicit Team(int64_t size) : size_(size), shares_(new Share[size]) {}
  int64_t size() const { return size_; }
  Share* shares() { return shares_.get(); }

  // Waits until every member has called it as often. Spins for a few microseconds (a member's wait between
  // products, where each has a core of its own), then sleeps until the last member wakes it: where the
  // machine has fewer free cores than the team has members (other processes, or a test run's workers), a
  // member whose partner lost its core gives the core up rather than spin against it.
  void barrier() {
    if (size_ == 1) return;
    const uint32_t generation = generation_.load();
    if (arrived_.fetch_add(1) + 1 == size_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1);
      if (sleepers_.load() > 0) wake_all(generation_);
      return;
    }
    wait_while(generation_, generation);
    if (failed_.load()) throw Abandoned{};
  }

  // One tensor for every member: member 0 makes it, the others take member 0's. The two slots alternate,
  // so member 0 fills one while a slower member may still be reading the other; a member reads its slot
  // before the next barrier, which member 0 passes before it fills that slot again.
  template <typename Make>
  at::Tensor one(Make&& make) {
    Member& m = t_member;
    at::Tensor& slot = slots_[calls_[m.me].n++ % 2];
    if (m.me == 0) slot = make();
    barrier();
    return slot;
  }

  // f(member) on `threads` of torch's threads at once, each with t_member set; false where the team could not
  // gather (fewer threads came than asked: f then ran nowhere). An exception in any member ends every
  // member's run and is thrown here.
  template <typename F>
  static bool run(int64_t threads, const F& f) {
    Team team(threads);
    std::atomic<int64_t> arrived{0};
    std::atomic<uint32_t> state{kGathering};
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      if (end - begin != 1) {  // this thread was given two places: the region has fewer threads than asked
        uint32_t gathering = kGathering;
        if (state.compare_exchange_strong(gathering, kAbandoned)) team.wake_all(state);
        return;
      }
      const int64_t me = arrived.fetch_add(1);
      if (me + 1 == threads) {
        uint32_t gathering = kGathering;
        if (state.compare_exchange_strong(gathering, kGo)) team.wake_all(state);
      }
      // The others should come at once; after 100 ms they are taken not to come (the region got fewer threads).
      if (!team.wait_while(state, kGathering, std::chrono::milliseconds(100))) {
        uint32_t gathering = kGathering;
        if (state.compare_exchange_strong(gathering, kAbandoned)) team.wake_all(state);
      }
      if (state.load() != kGo) return;
      t_member = Member{&team, me};
      try {
        f();
      } catch (const Abandoned&) {  // another member failed: its exception is the one kept
      } catch (...) {
        team.fail(std::current_exception());
      }
      t_member = Member{};
    });
    if (team.error_) std::rethrow_exception(team.error_);
    if (state.load() != kGo) return false;
    steps_run.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

 private:
  struct Abandoned {};
  static constexpr uint32_t kGathering = 0, kGo = 1, kAbandoned = 2;
  struct alignas(64) Calls {
    uint64_t n = 0;
  };

  // Returns once `word` is no longer `value` (true), or after `limit` (false). Spins for kSpin, then sleeps on
  // the word (a futex; elsewhere than Linux, yields the core), counted in sleepers_ so that a change wakes it.
  static constexpr auto kSpin = std::chrono::microseconds(20);
  bool wait_while(std::atomic<uint32_t>& word, uint32_t value,
                  std::chrono::nanoseconds limit = std::chrono::nanoseconds::max()) {
    const auto start = std::chrono::steady_clock::now();
    auto waited = std::chrono::nanoseconds(0);
    for (uint32_t spins = 0; word.load() == value; spins++) {
      if (failed_.load(std::memory_order_relaxed)) return true;
      if (spins % 64 == 63 || waited >= kSpin) waited = std::chrono::steady_clock::now() - start;
      if (waited > limit) return false;
      if (waited < kSpin) {
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#endif
        continue;
      }
      sleepers_.fetch_add(1);
#ifdef __linux__
      if (word.load() == value && !failed_.load()) {  // the kernel sleeps only while the word is still value
        const timespec most{0, 1000000};  // 1 ms at a time: a limit is seen, and nothing waits for ever on a bug
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, value, &most, nullptr, 0);
      }
#else
      std::this_thread::yield();
#endif
      sleepers_.fetch_sub(1);
    }
    return true;
  }

  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex is a 32-bit word");
  void wake_all(std::atomic<uint32_t>& word) {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
    (void)word;
#endif
  }

  void fail(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = error;
    failed_.store(true);
    wake_all(generation_);
  }

  const int64_t size_;
  std::unique_ptr<Share[]> shares_;
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  std::atomic<int64_t> sleepers_{0};
  std::atomic<bool> failed_{false};
  at::Tensor slots_[2];
  std::vector<Calls> calls_ = std::vector<Calls>(size_);
  std::mutex mutex_;
  std::exception_ptr error_;
};

// The calling thread's team, or null outside one (or in a team of one).
inline Team* team() { return t_member.team != nullptr && t_member.team->size() > 1 ? t_member.team : nullptr; }

}  // namespace llama
