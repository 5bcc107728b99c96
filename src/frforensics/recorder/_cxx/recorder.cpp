// frforensics' native recording path (issue 31; docs/recorder-native.md).
//
// A c10d::Backend that wraps the backend torch built for a group and records each
// op into a preallocated ring of plain structs: no Python object, no GIL, per op.
// The entry is the Python wrapper's (_pg.py: same slots, same sequence rules as
// _pg._frf_record/_advance/_frf_record_closing), so the dump writer reads both
// paths alike: ``Ring.snapshot()`` turns the live slots into the Python entry lists
// at dump time only.
//
// The stack: the calling thread's CPython 3.11 interpreter frames are walked
// without the GIL (every frame walked is live on this thread's stack below us and
// only this thread changes it); each code object is classified (kept or skipped by
// file prefix, as _ring.FrameFilter) once, with the GIL, and kept alive by the
// verdict cache, so a slot holds plain pointers. A thread with no Python thread
// state (DDP's reducer in the autograd engine) records no stack, as PyTorch's own
// recorder records none there.
//
// Completion: the group's previous op is settled when the next one is issued (as
// _pg._push); the watchdog's poll() settles the rest from the works, with the GIL
// released. Locking rule: nothing here waits for the GIL while holding mu_, and no
// Work is released while mu_ is held (a work's last reference frees its tensors,
// which takes the GIL for a tensor Python also holds); functions that drop works
// declare the holder before their lock_guard, so it is destroyed after the unlock.
//
// Releasing works: the recorder must never leave the *backend's* thread holding a
// work's last reference. gloo's worker drops its reference after finishing the op,
// under its queue lock; if that reference is the last, it frees the tensors there and
// waits for the GIL while holding the lock. Measured on torch 2.15.0: a process
// whose main thread then destroyed the group (joining gloo's threads with the GIL
// held) hung for good. So a settled work that someone else still references is
// deferred (retire) and released once the recorder's reference is the only one.
#include <torch/extension.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>
#include <c10/util/SmallVector.h>

#include <cxxabi.h>
#include <pthread.h>
#include <pythread.h>

#include <atomic>
#include <cstring>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE

#if PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030C0000
#error "frforensics' native recorder walks CPython 3.11 frames (the Python wrapper elsewhere)"
#endif

namespace {

constexpr int kMaxDepth = 32;  // frames kept per entry (the Python path has no cap)
constexpr int kMaxWalk = 256;  // frames examined before the walk gives up
constexpr int8_t kScheduled = 0, kCompleted = 2, kFailed = 3;
constexpr size_t kMaxDeferred = 4096;  // settled works awaiting release, at most

// Op names as the Python wrapper records them (_pg.py).
enum Op : int8_t {
  kAllReduce, kAllReduceCoalesced, kAllGather, kAllGatherIntoTensor, kAllGatherCoalesced,
  kAllGatherIntoTensorCoalesced, kBroadcast, kReduce, kGather, kScatter, kReduceScatter,
  kReduceScatterTensor, kReduceScatterTensorCoalesced, kAllToAllSingle, kAllToAll,
  kBarrier, kSend, kRecv, kRecvAnySource, kCoalesced, kNumOps
};
const char* const kOpNames[kNumOps] = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_into_tensor_coalesced", "broadcast", "reduce",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all", "barrier", "send",
    "recv", "recv_any_source", "coalesced"};

int64_t mono_ns() {
  // time.monotonic_ns(): CLOCK_MONOTONIC on Linux, as steady_clock.
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Shapes and dtypes of an op's tensors, inline for one tensor of up to 4 dims (the
// common op); a longer list goes to the heap once and keeps its capacity across
// reuses of the slot, so a warm ring allocates nothing per op.
struct Meta {
  c10::SmallVector<int64_t, 4> dims;
  c10::SmallVector<int8_t, 2> ndim;
  c10::SmallVector<int8_t, 2> dtype;
  void clear() {
    dims.clear();
    ndim.clear();
    dtype.clear();
  }
  void add(const at::Tensor& t) {
    auto sizes = t.sizes();
    ndim.push_back(static_cast<int8_t>(sizes.size()));
    dims.insert(dims.end(), sizes.begin(), sizes.end());
    dtype.push_back(static_cast<int8_t>(t.scalar_type()));
  }
  void add(const std::vector<at::Tensor>& ts) {
    for (const auto& t : ts) add(t);
  }
  void add(const std::vector<std::vector<at::Tensor>>& ts) {
    for (const auto& v : ts) add(v);
  }
};

struct Slot {
  int64_t rid = -1;
  int64_t group = 0, seq = 0, p2p_seq = 0, peer_seq = -1, peer = -1, root = -1, block = -1;
  int8_t op = 0, is_p2p = 0, reduce_op = -1, has_splits = 0;
  int8_t state = kScheduled;
  int64_t t_enqueue = 0, t_complete = 0, timeout_ms = 0;
  uint64_t thread = 0;
  Meta in, out;
  std::vector<int64_t> split_in, split_out;
  int depth = 0;  // frames in the ring's stack arrays at this slot's place
};

struct Evicted {
  Slot slot;
  std::vector<PyCodeObject*> codes;
  std::vector<int32_t> lastis;
};

struct Tracked {
  int64_t rid = -1;
  c10::intrusive_ptr<c10d::Work> work;
  bool has_future = true;  // false: stamped at wait() (RecordedWork), no result to read
};

// Per-group counters: PyTorch's semantics, as _core.GroupState.
struct Group {
  int64_t index = 0;
  std::vector<int64_t> ranks;  // group rank -> global rank
  int64_t timeout_ms = 0;
  int64_t seq = 0, p2p_seq = 0;
  std::unordered_map<int64_t, int64_t> send_count, recv_count;
  int64_t block_id = -1, block_p2p = -1;
  Tracked last;
  int64_t global_rank(int64_t r) const {
    return r >= 0 && r < static_cast<int64_t>(ranks.size()) ? ranks[static_cast<size_t>(r)]
                                                           : -1;
  }
};

// An unfinished op whose slot the ring reused: kept (with its stack) while the
// watchdog still tracks it, so a hang outlived by 2000 newer ops still fires.
struct Evicted;

struct Stack {
  int depth = 0;
  PyCodeObject* code[kMaxDepth];
  int32_t lasti[kMaxDepth];
};

bool work_failed(const c10::intrusive_ptr<c10d::Work>& w) {
  // _watchdog.work_failed: a finished work's future holds its error.
  try {
    auto fut = w->getFuture();
    if (!fut || !fut->completed()) return false;
    return fut->hasError();
  } catch (...) {
    return false;
  }
}

class Ring : public std::enable_shared_from_this<Ring> {
 public:
  Ring(int64_t capacity, int depth, std::vector<std::string> skip_prefixes, int64_t code_limit)
      : slots_(static_cast<size_t>(std::max<int64_t>(1, capacity))),
        depth_(std::max(0, std::min(depth, kMaxDepth))),
        codes_(slots_.size() * static_cast<size_t>(depth_)),
        lastis_(slots_.size() * static_cast<size_t>(depth_)),
        prefixes_(std::move(skip_prefixes)),
        code_limit_(code_limit) {}

  std::shared_ptr<Group> new_group(int64_t index, std::vector<int64_t> ranks,
                                   int64_t timeout_ms) {
    auto g = std::make_shared<Group>();
    g->index = index;
    g->ranks = std::move(ranks);
    g->timeout_ms = timeout_ms;
    std::lock_guard<std::mutex> lk(mu_);
    groups_.push_back(g);
    return g;
  }

  bool active() const { return active_.load(std::memory_order_relaxed); }
  void set_active(bool on) { active_.store(on); }
  int64_t capacity() const { return static_cast<int64_t>(slots_.size()); }
  int64_t count() {
    std::lock_guard<std::mutex> lk(mu_);
    return count_;
  }
  int64_t next_block() {
    std::lock_guard<std::mutex> lk(mu_);
    return ++blocks_;
  }

  // ------------------------------------------------------------ the hot path

  // Writes one entry; ``fill`` sets the tensors' metadata under the lock. Returns
  // the record id, or -1 when inactive or anything failed (never throws).
  // ``closing``: the closing entry of coalescing block ``closing`` (its counters
  // already advanced by record_closing).
  template <typename Fill>
  int64_t record(Group& g, Op op, bool is_p2p, int64_t peer, int64_t root, int8_t reduce_op,
                 Fill&& fill, int64_t closing = -1) {
    if (!active()) return -1;
    try {
      Stack st;
      walk(st);
      int64_t now = mono_ns();
      std::lock_guard<std::mutex> lk(mu_);
      int64_t seq, p2p_seq, peer_seq = -1;
      int64_t block = closing >= 0 ? closing : g.block_id;
      if (closing >= 0 || (block < 0 && !is_p2p)) {
        seq = closing >= 0 ? g.seq : ++g.seq;
        p2p_seq = g.p2p_seq;
      } else {
        advance(g, op, peer, is_p2p, block, seq, p2p_seq, peer_seq);
      }
      Slot& s = write(g, op, is_p2p, seq, p2p_seq, peer_seq, block, st, now);
      s.peer = peer;
      s.root = root;
      s.reduce_op = reduce_op;
      fill(s);
      return s.rid;
    } catch (abi::__forced_unwind&) {
      throw;  // a thread ended by the interpreter's shutdown: let it unwind
    } catch (...) {
      note_error();
      return -1;
    }
  }

  // The closing entry of a coalescing block (_pg._frf_record_closing): the
  // counters advance whether or not it is recorded.
  int64_t record_closing(Group& g, int64_t block, bool is_p2p) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (is_p2p) ++g.p2p_seq; else ++g.seq;
    }
    return record(g, kCoalesced, is_p2p, -1, -1, -1, [](Slot&) {}, block);
  }

  // _pg._push: ``rid`` becomes the group's newest op; the previous one, if its
  // work says it finished, is settled here (its result read: a few atomics in C++,
  // where the Python path leaves that to the watchdog) and its work released;
  // an unfinished one goes to the watchdog.
  void track(Group& g, int64_t rid, const c10::intrusive_ptr<c10d::Work>& work,
             bool has_future) {
    if (rid < 0 || !work) return;
    try {
      Tracked prev;  // released after mu_ (the locking rule at the top)
      std::lock_guard<std::mutex> lk(mu_);
      prev = std::move(g.last);
      g.last = Tracked{rid, work, has_future};
      Slot* s = slot_of(prev.rid);
      if (s != nullptr && s->state < kCompleted && !settle(*s, prev, mono_ns())) {
        pending_.push_back(std::move(prev));
      } else {
        forget(prev.rid);
        if (prev.work && !sole(prev)) retire(std::move(prev));
      }
    } catch (abi::__forced_unwind&) {
      throw;  // a thread ended by the interpreter's shutdown: let it unwind
    } catch (...) {
      note_error();
    }
  }

  // Stamps an op from its work's wait() (works without a future: gloo p2p and
  // reduce_scatter, as _pg.RecordedWork).
  void stamp(int64_t rid, bool failed) noexcept {
    std::lock_guard<std::mutex> lk(mu_);
    Slot* s = slot_of(rid);
    if (s != nullptr && s->state < kCompleted) {
      s->t_complete = mono_ns();
      s->state = failed ? kFailed : kCompleted;
    }
  }

  void set_splits(int64_t rid, const std::vector<int64_t>& in,
                  const std::vector<int64_t>& out) {
    try {
      std::lock_guard<std::mutex> lk(mu_);
      Slot* s = slot_of(rid);
      if (s != nullptr) {
        s->split_in.assign(in.begin(), in.end());
        s->split_out.assign(out.begin(), out.end());
        s->has_splits = 1;
      }
    } catch (abi::__forced_unwind&) {
      throw;  // a thread ended by the interpreter's shutdown: let it unwind
    } catch (...) {
      note_error();
    }
  }

  // ------------------------------------------------------------ the watchdog

  // _watchdog._poll_locked: settle what can be settled; the oldest unfinished
  // op's (record id, enqueue time), or (-1, 0). Called with the GIL released.
  std::pair<int64_t, int64_t> poll() {
    std::vector<Tracked> still;  // after the swap below: the settled works, released after mu_
    std::vector<Tracked> free;   // deferred works now held by the recorder alone
    std::lock_guard<std::mutex> lk(mu_);
    int64_t now = mono_ns();
    sweep(free, false);
    while (!pending_.empty()) {
      tracked_.push_back(std::move(pending_.front()));
      pending_.pop_front();
    }
    int64_t oldest = -1, oldest_t = 0;
    still.reserve(tracked_.size());
    for (auto& item : tracked_) {
      Slot* s = slot_of(item.rid);
      if (s == nullptr || s->state >= kCompleted || settle(*s, item, now)) {
        forget(item.rid);
        if (!sole(item)) retire(std::move(item));
        continue;
      }
      if (oldest < 0 || s->t_enqueue < oldest_t) {
        oldest = item.rid;
        oldest_t = s->t_enqueue;
      }
      still.push_back(std::move(item));
    }
    tracked_.swap(still);
    for (auto& g : groups_) {
      if (g->last.rid < 0) continue;
      Slot* s = slot_of(g->last.rid);
      if (s == nullptr || s->state >= kCompleted || settle(*s, g->last, now)) {
        forget(g->last.rid);
        continue;
      }
      if (oldest < 0 || s->t_enqueue < oldest_t) {
        oldest = g->last.rid;
        oldest_t = s->t_enqueue;
      }
    }
    return {oldest, oldest_t};
  }

  // _watchdog.settle_for_dump: each group's newest op marked failed if it was.
  void settle_for_dump() {
    poll();
    std::lock_guard<std::mutex> lk(mu_);
    int64_t now = mono_ns();
    for (auto& g : groups_) {
      if (g->last.rid < 0) continue;
      Slot* s = slot_of(g->last.rid);
      if (s != nullptr && s->state == kCompleted && g->last.has_future &&
          work_failed(g->last.work)) {
        s->state = kFailed;
        if (s->t_complete == 0) s->t_complete = now;
      }
    }
  }

  bool unfinished() {
    poll();
    std::lock_guard<std::mutex> lk(mu_);
    if (!tracked_.empty()) return true;
    for (auto& g : groups_) {
      if (g->last.rid < 0) continue;
      Slot* s = slot_of(g->last.rid);
      if (s != nullptr && s->state < kCompleted) return true;
    }
    return false;
  }

  // Every work released (before the interpreter's shutdown). A work another holder
  // still references is released once the recorder's reference is the last, waiting
  // up to ``wait_ms`` for the backend's thread to drop its own (called without the GIL).
  void drop_works(int64_t wait_ms) {
    {
      std::deque<Tracked> pending;  // released after mu_
      std::vector<Tracked> tracked;
      std::lock_guard<std::mutex> lk(mu_);
      pending.swap(pending_);
      tracked.swap(tracked_);
      for (auto& t : pending) retire(std::move(t));
      for (auto& t : tracked) retire(std::move(t));
      for (auto& g : groups_) {
        retire(std::move(g->last));
        g->last = Tracked{};  // nothing tracked (a moved-from one keeps its id)
      }
      evicted_.clear();
    }
    int64_t deadline = mono_ns() + wait_ms * 1000000;
    for (;;) {
      std::vector<Tracked> free;
      bool left;
      {
        std::lock_guard<std::mutex> lk(mu_);
        bool last_try = mono_ns() >= deadline;
        sweep(free, last_try);
        left = !deferred_.empty();
      }
      if (!left) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  // ------------------------------------------------------------ dump time

  // The live entries oldest first as the Python wrapper's entry lists (_ring.py's
  // slots), and how many were overwritten. ``rid >= 0``: that entry only.
  py::tuple snapshot(int64_t only_rid) {
    std::vector<Slot> copy;
    std::vector<PyCodeObject*> codes;
    std::vector<int32_t> lastis;
    int64_t dropped = 0;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lk(mu_);
      int64_t cap = capacity();
      dropped = std::max<int64_t>(0, count_ - cap);
      int64_t first = only_rid >= 0 ? only_rid : std::max<int64_t>(0, count_ - cap);
      int64_t last = only_rid >= 0 ? std::min(only_rid + 1, count_) : count_;
      for (int64_t rid = first; rid < last; ++rid) {
        Slot* s = slot_of(rid);
        if (s == nullptr) continue;
        copy.push_back(*s);
        auto ev = s->rid == slots_[static_cast<size_t>(rid % cap)].rid ? evicted_.end()
                                                                       : evicted_.find(rid);
        if (ev != evicted_.end()) {  // an unfinished op the ring no longer holds
          codes.insert(codes.end(), ev->second.codes.begin(), ev->second.codes.end());
          lastis.insert(lastis.end(), ev->second.lastis.begin(), ev->second.lastis.end());
          continue;
        }
        size_t at = static_cast<size_t>(rid % cap) * static_cast<size_t>(depth_);
        codes.insert(codes.end(), codes_.begin() + static_cast<std::ptrdiff_t>(at),
                     codes_.begin() + static_cast<std::ptrdiff_t>(at) + s->depth);
        lastis.insert(lastis.end(), lastis_.begin() + static_cast<std::ptrdiff_t>(at),
                      lastis_.begin() + static_cast<std::ptrdiff_t>(at) + s->depth);
      }
    }
    py::list out;
    py::object none = py::none();
    py::object red_type = py::module_::import("torch.distributed").attr("ReduceOp").attr(
        "RedOpType");
    size_t frame = 0;
    for (const Slot& s : copy) {
      py::list e(23);
      e[0] = s.rid;
      e[1] = s.group;
      e[2] = s.seq;
      e[3] = s.p2p_seq;
      e[4] = s.peer_seq;
      e[5] = kOpNames[s.op];
      e[6] = py::bool_(s.is_p2p != 0);
      e[7] = s.peer;
      e[8] = s.root;
      e[9] = s.block;
      e[10] = meta(s.in);
      e[11] = meta(s.out);
      e[12] = s.reduce_op >= 0 ? red_type(static_cast<int>(s.reduce_op)) : none;
      e[13] = static_cast<int>(s.state);
      e[14] = s.t_enqueue;
      e[15] = 0;
      e[16] = s.t_complete;
      e[17] = s.timeout_ms;
      e[18] = s.thread;
      e[19] = none;
      e[20] = -1;
      py::list stack;
      for (int k = 0; k < s.depth; ++k, ++frame) {
        stack.append(py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(codes[frame])));
        stack.append(static_cast<int>(lastis[frame]));
      }
      e[21] = stack;
      e[22] = none;
      if (s.has_splits) {
        e.append(py::make_tuple(py::tuple(py::cast(s.split_in)),
                                py::tuple(py::cast(s.split_out))));
      }
      out.append(e);
    }
    return py::make_tuple(out, dropped);
  }

  // What the ring holds in memory: the slots and the metadata vectors they own.
  int64_t bytes() {
    std::lock_guard<std::mutex> lk(mu_);
    size_t n = slots_.capacity() * sizeof(Slot) + codes_.capacity() * sizeof(PyCodeObject*) +
               lastis_.capacity() * sizeof(int32_t);
    for (const Slot& s : slots_) {  // what went to the heap (beyond the inline storage)
      for (const Meta* m : {&s.in, &s.out}) {
        if (m->dims.capacity() > 4) n += m->dims.capacity() * 8;
        if (m->ndim.capacity() > 2) n += m->ndim.capacity();
        if (m->dtype.capacity() > 2) n += m->dtype.capacity();
      }
      n += (s.split_in.capacity() + s.split_out.capacity()) * 8;
    }
    return static_cast<int64_t>(n);
  }

  int64_t errors() const { return errors_.load(); }
  int64_t deferred() {
    std::lock_guard<std::mutex> lk(mu_);
    return static_cast<int64_t>(deferred_.size());
  }
  int64_t codes_known() {
    std::lock_guard<std::mutex> lk(code_mu_);
    return static_cast<int64_t>(verdicts_.size());
  }

 private:
  static void advance(Group& g, Op op, int64_t peer, bool is_p2p, int64_t block, int64_t& seq,
                      int64_t& p2p_seq, int64_t& peer_seq) {
    // _pg._advance
    if (block < 0) {
      ++g.p2p_seq;
      seq = g.seq;
      p2p_seq = g.p2p_seq;
    } else {
      if (g.block_p2p < 0) g.block_p2p = is_p2p ? 1 : 0;
      if (g.block_p2p) {
        seq = g.seq;
        p2p_seq = g.p2p_seq + 1;
      } else {
        seq = g.seq + 1;
        p2p_seq = g.p2p_seq;
      }
    }
    peer_seq = -1;
    if (is_p2p) {
      auto& counts = op == kSend ? g.send_count : g.recv_count;
      peer_seq = ++counts[peer];
    }
  }

  static bool sole(const Tracked& t);  // after RecordedWork

  // Keeps an unfinished op's slot and stack before the ring reuses them (mu_ held).
  // Bounded by the ops still unfinished; each is forgotten once settled.
  void evict(const Slot& s) {
    if (evicted_.size() >= kMaxDeferred) return;
    Evicted& e = evicted_[s.rid];
    e.slot = s;
    size_t at = static_cast<size_t>(s.rid % capacity()) * static_cast<size_t>(depth_);
    e.codes.assign(codes_.begin() + static_cast<std::ptrdiff_t>(at),
                   codes_.begin() + static_cast<std::ptrdiff_t>(at) + s.depth);
    e.lastis.assign(lastis_.begin() + static_cast<std::ptrdiff_t>(at),
                    lastis_.begin() + static_cast<std::ptrdiff_t>(at) + s.depth);
  }
  void forget(int64_t rid) {
    if (!evicted_.empty()) evicted_.erase(rid);
  }

  // Keeps a settled work whose last reference may not be ours (called with mu_ held).
  void retire(Tracked&& t) {
    if (t.work) deferred_.push_back(std::move(t));
  }

  // Moves into ``out`` (released by the caller after mu_) the deferred works now held
  // by the recorder alone; ``all``: every one. At most kMaxDeferred are kept: past
  // that the oldest go anyway (a caller that keeps its work handles holds them).
  void sweep(std::vector<Tracked>& out, bool all) {
    std::vector<Tracked> keep;
    size_t over = deferred_.size() > kMaxDeferred ? deferred_.size() - kMaxDeferred : 0;
    for (size_t i = 0; i < deferred_.size(); ++i) {
      if (all || i < over || sole(deferred_[i])) {
        out.push_back(std::move(deferred_[i]));
      } else {
        keep.push_back(std::move(deferred_[i]));
      }
    }
    deferred_.swap(keep);
  }

  // The next slot, filled with what every entry has (peer, root and reduce op
  // unset; tensors cleared). Called with mu_ held.
  Slot& write(const Group& g, Op op, bool is_p2p, int64_t seq, int64_t p2p_seq,
              int64_t peer_seq, int64_t block, const Stack& st, int64_t now) {
    int64_t rid = count_++;
    Slot& s = slots_[static_cast<size_t>(rid % capacity())];
    if (s.rid >= 0 && s.state < kCompleted) evict(s);
    s.rid = rid;
    s.group = g.index;
    s.seq = seq;
    s.p2p_seq = p2p_seq;
    s.peer_seq = peer_seq;
    s.op = op;
    s.is_p2p = is_p2p ? 1 : 0;
    s.peer = -1;
    s.root = -1;
    s.block = block;
    s.reduce_op = -1;
    s.state = kScheduled;
    s.t_enqueue = now;
    s.t_complete = 0;
    s.timeout_ms = g.timeout_ms;
    s.thread = static_cast<uint64_t>(PyThread_get_thread_ident());
    s.in.clear();
    s.out.clear();
    s.has_splits = 0;
    s.depth = st.depth;
    size_t at = static_cast<size_t>(rid % capacity()) * static_cast<size_t>(depth_);
    for (int k = 0; k < st.depth; ++k) {
      codes_[at + static_cast<size_t>(k)] = st.code[k];
      lastis_[at + static_cast<size_t>(k)] = st.lasti[k];
    }
    return s;
  }

  Slot* slot_of(int64_t rid) {
    if (rid < 0) return nullptr;
    Slot& s = slots_[static_cast<size_t>(rid % capacity())];
    if (s.rid == rid) return &s;
    if (evicted_.empty()) return nullptr;
    auto it = evicted_.find(rid);
    return it == evicted_.end() ? nullptr : &it->second.slot;
  }

  static bool settle(Slot& s, const Tracked& t, int64_t now) {
    if (!t.work) return true;  // released: nothing left to learn
    bool done, failed;
    try {
      done = t.work->isCompleted();
      failed = done && t.has_future && work_failed(t.work);
    } catch (...) {
      done = failed = true;
    }
    if (!done) return false;
    if (s.state < kCompleted) {
      s.t_complete = now;
      s.state = failed ? kFailed : kCompleted;
    }
    return true;
  }

  static py::tuple meta(const Meta& m) {
    py::tuple out(m.ndim.size());
    size_t at = 0;
    for (size_t i = 0; i < m.ndim.size(); ++i) {
      py::tuple shape(static_cast<size_t>(m.ndim[i]));
      for (int d = 0; d < m.ndim[i]; ++d) shape[static_cast<size_t>(d)] = m.dims[at++];
      auto* dt = reinterpret_cast<PyObject*>(
          torch::getTHPDtype(static_cast<at::ScalarType>(m.dtype[i])));
      out[i] = py::make_tuple(shape, py::reinterpret_borrow<py::object>(dt));
    }
    return out;
  }

  void note_error() noexcept { errors_.fetch_add(1); }

  // The caller's kept frames, innermost first (_ring.capture_stack's result).
  void walk(Stack& st) {
    st.depth = 0;
    if (depth_ == 0 || _Py_IsFinalizing()) return;
    PyThreadState* ts = PyGILState_GetThisThreadState();
    if (ts == nullptr || ts->cframe == nullptr) return;
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::vector<PyCodeObject*> unknown;
      {
        std::lock_guard<std::mutex> lk(code_mu_);
        st.depth = 0;
        int walked = 0;
        for (_PyInterpreterFrame* f = ts->cframe->current_frame;
             f != nullptr && st.depth < depth_ && walked < kMaxWalk; f = f->previous) {
          ++walked;
          if (_PyFrame_IsIncomplete(f)) continue;
          PyCodeObject* code = f->f_code;
          auto it = verdicts_.find(code);
          if (it == verdicts_.end()) {
            unknown.push_back(code);
            if (attempt > 0) break;  // the cache is full: stop here
            continue;
          }
          if (!it->second) continue;
          int lasti = _PyInterpreterFrame_LASTI(f);
          st.code[st.depth] = code;
          st.lasti[st.depth] = lasti < 0 ? -1 : lasti * static_cast<int>(sizeof(_Py_CODEUNIT));
          ++st.depth;
        }
      }
      if (unknown.empty() || attempt > 0 || codes_full_.load(std::memory_order_relaxed)) return;
      classify(unknown);
    }
  }

  void classify(const std::vector<PyCodeObject*>& codes) {
    PyGILState_STATE gil = PyGILState_Ensure();
    {
      std::lock_guard<std::mutex> lk(code_mu_);
      for (PyCodeObject* code : codes) {
        if (verdicts_.count(code) || static_cast<int64_t>(verdicts_.size()) >= code_limit_) {
          continue;
        }
        const char* file = PyUnicode_AsUTF8(code->co_filename);
        bool keep = true;
        if (file == nullptr) {
          PyErr_Clear();
        } else {
          for (const auto& p : prefixes_) {
            if (std::strncmp(file, p.c_str(), p.size()) == 0) {
              keep = false;
              break;
            }
          }
        }
        Py_INCREF(code);  // never freed while its verdict (and slots) may point at it
        verdicts_.emplace(code, keep);
      }
      // full: stacks stop at the first frame of a code object not seen before, and
      // no op takes the GIL again (the slots hold plain pointers: the cache cannot be
      // emptied as the Python path's FrameFilter is)
      if (static_cast<int64_t>(verdicts_.size()) >= code_limit_) codes_full_.store(true);
    }
    PyGILState_Release(gil);
  }

  std::mutex mu_;  // slots, counters, groups, works
  std::vector<Slot> slots_;
  int depth_;
  // slot i's stack: codes_[i * depth_ ...], lastis_[i * depth_ ...]; the code
  // objects are kept alive by verdicts_
  std::vector<PyCodeObject*> codes_;
  std::vector<int32_t> lastis_;
  int64_t count_ = 0;
  int64_t blocks_ = 0;
  std::vector<std::shared_ptr<Group>> groups_;
  std::deque<Tracked> pending_;
  std::vector<Tracked> tracked_;
  std::vector<Tracked> deferred_;  // settled, released once ours is the last reference
  std::unordered_map<int64_t, Evicted> evicted_;
  std::atomic<bool> active_{true};
  std::atomic<int64_t> errors_{0};
  std::vector<std::string> prefixes_;
  int64_t code_limit_;
  std::mutex code_mu_;
  std::unordered_map<PyCodeObject*, bool> verdicts_;
  std::atomic<bool> codes_full_{false};
};

// A work whose is_completed() stays false until waited on (gloo p2p and
// reduce_scatter): stamps its entry at wait(), as _pg.RecordedWork.
class RecordedWork : public c10d::Work {
 public:
  RecordedWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<Ring> ring, int64_t rid)
      : inner_(std::move(inner)), ring_(std::move(ring)), rid_(rid) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override {
    bool ok;
    try {
      ok = inner_->wait(timeout);
    } catch (...) {
      ring_->stamp(rid_, true);
      throw;
    }
    ring_->stamp(rid_, false);
    return ok;
  }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  bool inner_sole() const { return inner_.use_count() <= 1; }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<Ring> ring_;
  int64_t rid_;
};

// True when the recorder holds the last reference to the work (and, for a work it
// wrapped, the wrapper holds the last one to the backend's work).
bool Ring::sole(const Tracked& t) {
  if (!t.work) return true;
  if (t.work.use_count() > 1) return false;
  return t.has_future || static_cast<const RecordedWork*>(t.work.get())->inner_sole();
}

int8_t red(const c10d::ReduceOp& op) { return static_cast<int8_t>(op.op_); }

class RecordingBackend : public c10d::Backend {
 public:
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;

  RecordingBackend(c10::intrusive_ptr<c10d::Backend> inner, std::shared_ptr<Ring> ring,
                   std::shared_ptr<Group> group)
      : Backend(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)),
        ring_(std::move(ring)),
        group_(std::move(group)),
        no_future_(inner_->getBackendName() == "gloo") {}

  c10::intrusive_ptr<c10d::Backend> inner() const { return inner_; }

  const std::string getBackendName() const override { return inner_->getBackendName(); }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return inner_->getBackendOptions();
  }
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  // split_group: the inner backend splits; the new group is wrapped by _c10d's
  // split_group hook, as every split group is.
  bool supportsSplitting() const override { return inner_->supportsSplitting(); }
  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                    const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override {
    return inner_->split(store, ranks, opts);
  }
  void setTimeout(std::chrono::milliseconds t) override { inner_->setTimeout(t); }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
  void waitForPendingWorks() override { inner_->waitForPendingWorks(); }
  void enableCollectivesTiming() override { inner_->enableCollectivesTiming(); }
  void setGroupUid(const std::string& uid) override {
    Backend::setGroupUid(uid);
    inner_->setGroupUid(uid);
  }
  void eagerConnectSingleDevice(at::Device d) override { inner_->eagerConnectSingleDevice(d); }
  c10d::ErrorType getError() override { return inner_->getError(); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all) override {
    inner_->monitoredBarrier(o, wait_all);
  }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 15)
  bool isInitialized() override { return inner_->isInitialized(); }
  std::optional<at::Device> getBoundDeviceId() const override {
    return inner_->getBoundDeviceId();
  }
  void setBoundDeviceId(std::optional<at::Device> d) override {
    Backend::setBoundDeviceId(d);
    inner_->setBoundDeviceId(d);
  }
  void addEphemeralTimeout(const std::chrono::milliseconds& t) override {
    inner_->addEphemeralTimeout(t);
  }
  // Reconfiguration (the loop's spare): the inner backend re-forms; _reconfig gives
  // the group its new identity through set_group.
  bool supportsReconfigure() const override { return inner_->supportsReconfigure(); }
  c10d::ReconfigureHandle get_reconfigure_handle() const override {
    return inner_->get_reconfigure_handle();
  }
  WorkPtr reconfigure(const c10d::ReconfigureOptions& o) override {
    WorkPtr work = inner_->reconfigure(o);
    sync_membership();
    return work;
  }
#endif

  // The group's rank and size as the inner backend has them now: ProcessGroup's
  // getRank()/getSize() read the default backend's (2.15), and Backend's are not
  // virtual, so a re-formed inner backend's are copied here.
  void sync_membership() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 15)
    rank_ = inner_->getRank();  // const before 2.15, where nothing re-forms a backend
    size_ = inner_->getSize();
#endif
  }

  // The group whose counters this backend advances; re-bound after a reconfigure,
  // while none of the group's ops is in flight (they failed or finished).
  std::shared_ptr<Group> group() const { return group_; }
  void set_group(std::shared_ptr<Group> g) {
    group_ = std::move(g);
    sync_membership();
  }

  // ---------------------------------------------------------------- collectives

  WorkPtr allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    int64_t rid = rec(kAllReduce, -1, red(o.reduceOp), t, t);
    return done(rid, inner_->allreduce(t, o), false);
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& t,
                              const c10d::AllreduceCoalescedOptions& o) override {
    int64_t rid = rec(kAllReduceCoalesced, -1, red(o.reduceOp), t, t);
    return done(rid, inner_->allreduce_coalesced(t, o), false);
  }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                    const c10d::AllgatherOptions& o) override {
    int64_t rid = rec(kAllGather, -1, -1, in, out);
    return done(rid, inner_->allgather(out, in, o), false);
  }
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in,
                          const c10d::AllgatherOptions& o) override {
    int64_t rid = rec(kAllGatherIntoTensor, -1, -1, in, out);
    return done(rid, inner_->_allgather_base(out, in, o), false);
  }
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                              std::vector<at::Tensor>& in,
                              const c10d::AllgatherOptions& o) override {
    int64_t rid = rec(kAllGatherCoalesced, -1, -1, in, out);
    return done(rid, inner_->allgather_coalesced(out, in, o), false);
  }
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                          std::vector<at::Tensor>& in,
                                          const c10d::AllgatherOptions& o) override {
    int64_t rid = rec(kAllGatherIntoTensorCoalesced, -1, -1, in, out);
    return done(rid, inner_->allgather_into_tensor_coalesced(out, in, o), false);
  }
  WorkPtr broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    int64_t rid = rec(kBroadcast, group_->global_rank(o.rootRank), -1, t, t);
    return done(rid, inner_->broadcast(t, o), false);
  }
  WorkPtr reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    int64_t rid = rec(kReduce, group_->global_rank(o.rootRank), red(o.reduceOp), t, t);
    return done(rid, inner_->reduce(t, o), false);
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                 const c10d::GatherOptions& o) override {
    int64_t rid = rec(kGather, group_->global_rank(o.rootRank), -1, in, out);
    return done(rid, inner_->gather(out, in, o), false);
  }
  WorkPtr scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                  const c10d::ScatterOptions& o) override {
    int64_t rid = rec(kScatter, group_->global_rank(o.rootRank), -1, in, out);
    return done(rid, inner_->scatter(out, in, o), false);
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                         const c10d::ReduceScatterOptions& o) override {
    int64_t rid = rec(kReduceScatter, -1, red(o.reduceOp), in, out);
    return done(rid, inner_->reduce_scatter(out, in, o), no_future_);
  }
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                               const c10d::ReduceScatterOptions& o) override {
    int64_t rid = rec(kReduceScatterTensor, -1, red(o.reduceOp), in, out);
    return done(rid, inner_->_reduce_scatter_base(out, in, o), no_future_);
  }
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                          std::vector<at::Tensor>& in,
                                          const c10d::ReduceScatterOptions& o) override {
    int64_t rid = rec(kReduceScatterTensorCoalesced, -1, red(o.reduceOp), in, out);
    return done(rid, inner_->reduce_scatter_tensor_coalesced(out, in, o), no_future_);
  }
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                        std::vector<int64_t>& in_splits,
                        const c10d::AllToAllOptions& o) override {
    int64_t rid = rec(kAllToAllSingle, -1, -1, in, out);
    if (rid >= 0 && (!in_splits.empty() || !out_splits.empty())) {
      ring_->set_splits(rid, in_splits, out_splits);
    }
    return done(rid, inner_->alltoall_base(out, in, out_splits, in_splits, o), false);
  }
  WorkPtr alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                   const c10d::AllToAllOptions& o) override {
    int64_t rid = rec(kAllToAll, -1, -1, in, out);
    return done(rid, inner_->alltoall(out, in, o), false);
  }
  WorkPtr barrier(const c10d::BarrierOptions& o) override {
    std::vector<at::Tensor> none;
    int64_t rid = rec(kBarrier, -1, -1, none, none);
    return done(rid, inner_->barrier(o), false);
  }

  // ---------------------------------------------------------------- p2p

  WorkPtr send(std::vector<at::Tensor>& t, int dst, int tag) override {
    int64_t rid = p2p(kSend, group_->global_rank(dst), t);
    return done(rid, inner_->send(t, dst, tag), no_future_);
  }
  WorkPtr recv(std::vector<at::Tensor>& t, int src, int tag) override {
    int64_t rid = p2p(kRecv, group_->global_rank(src), t);
    return done(rid, inner_->recv(t, src, tag), no_future_);
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    int64_t rid = p2p(kRecvAnySource, -1, t);
    return done(rid, inner_->recvAnysource(t, tag), no_future_);
  }

  // ---------------------------------------------------------------- coalescing

  void startCoalescing() override {
    inner_->startCoalescing();
    group_->block_id = ring_->next_block();
    group_->block_p2p = -1;
  }
  WorkPtr endCoalescing() override {
    WorkPtr work;
    int64_t block = group_->block_id, kind = group_->block_p2p;
    try {
      work = inner_->endCoalescing();
    } catch (...) {
      group_->block_id = -1;
      group_->block_p2p = -1;
      throw;
    }
    group_->block_id = -1;
    group_->block_p2p = -1;
    if (block < 0 || kind < 0) return work;  // an empty block issues nothing
    int64_t rid = ring_->record_closing(*group_, block, kind != 0);
    return done(rid, work, false);
  }

 private:
  // A collective's entry: ``in`` and ``out`` a tensor, a list or a list of lists.
  template <typename In, typename Out>
  int64_t rec(Op op, int64_t root, int8_t reduce_op, const In& in, const Out& out) {
    return ring_->record(*group_, op, false, -1, root, reduce_op, [&](Slot& s) {
      s.in.add(in);
      s.out.add(out);
    });
  }
  int64_t p2p(Op op, int64_t peer, const std::vector<at::Tensor>& t) {
    return ring_->record(*group_, op, true, peer, -1, -1, [&](Slot& s) {
      s.in.add(t);
      s.out.add(t);
    });
  }

  WorkPtr done(int64_t rid, WorkPtr work, bool wrap) {
    if (rid < 0 || !work) return work;
    if (wrap) work = c10::make_intrusive<RecordedWork>(std::move(work), ring_, rid);
    ring_->track(*group_, rid, work, !wrap);
    return work;
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  std::shared_ptr<Ring> ring_;
  std::shared_ptr<Group> group_;
  bool no_future_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Group, std::shared_ptr<Group>>(m, "Group")
      .def_readonly("index", &Group::index)
      .def_readonly("seq", &Group::seq)
      .def_readonly("p2p_seq", &Group::p2p_seq);
  py::class_<Ring, std::shared_ptr<Ring>>(m, "Ring")
      .def(py::init<int64_t, int, std::vector<std::string>, int64_t>())
      .def("new_group", &Ring::new_group, py::call_guard<py::gil_scoped_release>())
      .def("set_active", &Ring::set_active)
      .def_property_readonly("capacity", &Ring::capacity)
      .def("count", &Ring::count, py::call_guard<py::gil_scoped_release>())
      .def("poll", &Ring::poll, py::call_guard<py::gil_scoped_release>())
      .def("settle_for_dump", &Ring::settle_for_dump, py::call_guard<py::gil_scoped_release>())
      .def("unfinished", &Ring::unfinished, py::call_guard<py::gil_scoped_release>())
      .def("drop_works", &Ring::drop_works, py::arg("wait_ms") = 200,
           py::call_guard<py::gil_scoped_release>())
      .def("deferred", &Ring::deferred, py::call_guard<py::gil_scoped_release>())
      .def("snapshot", &Ring::snapshot, py::arg("only_rid") = -1)
      .def("errors", &Ring::errors)
      .def("bytes", &Ring::bytes, py::call_guard<py::gil_scoped_release>())
      .def("codes_known", &Ring::codes_known);
  py::class_<RecordingBackend, c10d::Backend, c10::intrusive_ptr<RecordingBackend>>(
      m, "RecordingBackend")
      .def("inner", &RecordingBackend::inner)
      .def("group", &RecordingBackend::group)
      .def("set_group", &RecordingBackend::set_group);
  m.def("wrap", [](c10::intrusive_ptr<c10d::Backend> inner, std::shared_ptr<Ring> ring,
                   std::shared_ptr<Group> group) {
    return c10::make_intrusive<RecordingBackend>(std::move(inner), std::move(ring),
                                                 std::move(group));
  });
}
