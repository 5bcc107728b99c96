// A measurement of issue 31's route, not the recorder: a C++ c10d::Backend that wraps
// the real one and records each op into a preallocated ring of plain structs (no
// Python object per op), with the caller's Python frames optionally taken as code
// references (the GIL taken for the walk, as PyTorch's FlightRecorder does through
// CapturedTraceback::gather). Built JIT by bench_native_spike.py.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE

namespace {

constexpr int kDepth = 8;

enum Op : int8_t { kAllreduce, kBroadcast, kBarrier, kAllgather, kAllgatherBase,
                   kReduceScatterBase, kSend, kRecv, kOther };

struct Entry {
  int64_t record_id;
  int64_t seq;
  int64_t numel;
  int64_t t_enqueue_ns;
  std::atomic<int64_t> t_complete_ns;
  int8_t op;
  int8_t dtype;
  std::atomic<int8_t> state;  // 0 scheduled, 2 completed
  int8_t depth;
  PyCodeObject* code[kDepth];
  int32_t lasti[kDepth];
};

int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

class RecordingBackend : public c10d::Backend {
 public:
  RecordingBackend(c10::intrusive_ptr<c10d::Backend> inner, int64_t capacity, bool stacks)
      : Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)),
        ring_(static_cast<size_t>(capacity)), stacks_(stacks) {
    for (auto& e : ring_) {
      e.depth = 0;
    }
  }

  const std::string getBackendName() const override { return inner_->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t,
                                           const c10d::AllreduceOptions& o) override {
    Entry& e = record(kAllreduce, t);
    auto w = inner_->allreduce(t, o);
    track(e, w);
    return w;
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t,
                                           const c10d::BroadcastOptions& o) override {
    Entry& e = record(kBroadcast, t);
    auto w = inner_->broadcast(t, o);
    track(e, w);
    return w;
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    std::vector<at::Tensor> none;
    Entry& e = record(kBarrier, none);
    auto w = inner_->barrier(o);
    track(e, w);
    return w;
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out,
                                           std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o) override {
    Entry& e = record(kAllgather, in);
    auto w = inner_->allgather(out, in, o);
    track(e, w);
    return w;
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    std::vector<at::Tensor> v{in};
    Entry& e = record(kAllgatherBase, v);
    auto w = inner_->_allgather_base(out, in, o);
    track(e, w);
    return w;
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    std::vector<at::Tensor> v{in};
    Entry& e = record(kReduceScatterBase, v);
    auto w = inner_->_reduce_scatter_base(out, in, o);
    track(e, w);
    return w;
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    Entry& e = record(kSend, t);
    auto w = inner_->send(t, dst, tag);
    track(e, w);
    return w;
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    Entry& e = record(kRecv, t);
    auto w = inner_->recv(t, src, tag);
    track(e, w);
    return w;
  }

  int64_t count() const { return count_.load(); }

  // Completion, learned without the GIL: the newest op's work polled here (the
  // spike's stand-in for a native watchdog thread).
  int64_t poll() {
    std::lock_guard<std::mutex> g(last_mu_);
    if (last_work_ && last_entry_ && last_entry_->state.load() == 0 &&
        last_work_->isCompleted()) {
      last_entry_->t_complete_ns.store(mono_ns());
      last_entry_->state.store(2);
      return 1;
    }
    return 0;
  }

  // The ring as columns, read at dump time only (the spike returns a few).
  std::vector<int64_t> seqs() const {
    std::vector<int64_t> out;
    int64_t n = std::min<int64_t>(count_.load(), static_cast<int64_t>(ring_.size()));
    out.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out.push_back(ring_[static_cast<size_t>(i)].seq);
    return out;
  }

  int64_t frames_of(int64_t i) const {
    return ring_[static_cast<size_t>(i % static_cast<int64_t>(ring_.size()))].depth;
  }

 private:
  Entry& record(Op op, const std::vector<at::Tensor>& t) {
    int64_t id = count_.fetch_add(1);
    Entry& e = ring_[static_cast<size_t>(id % static_cast<int64_t>(ring_.size()))];
    e.record_id = id;
    e.seq = ++seq_;
    e.op = op;
    int64_t numel = 0;
    for (const auto& x : t) numel += x.numel();
    e.numel = numel;
    e.dtype = t.empty() ? -1 : static_cast<int8_t>(t[0].scalar_type());
    e.t_enqueue_ns = mono_ns();
    e.t_complete_ns.store(0);
    e.state.store(0);
    if (stacks_) {
      capture(e);
    }
    return e;
  }

  void capture(Entry& e) {
    if (!Py_IsInitialized()) {
      return;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    for (int k = 0; k < e.depth; ++k) {
      Py_XDECREF(e.code[k]);  // the slot's previous stack, overwritten
    }
    e.depth = 0;
    PyThreadState* ts = PyThreadState_Get();
    _PyInterpreterFrame* f = ts->cframe ? ts->cframe->current_frame : nullptr;
    int walked = 0;
    while (f != nullptr && e.depth < kDepth && walked < 64) {
      ++walked;
      if (!_PyFrame_IsIncomplete(f)) {
        PyCodeObject* code = f->f_code;
        Py_INCREF(code);
        e.code[e.depth] = code;
        e.lasti[e.depth] = _PyInterpreterFrame_LASTI(f) * static_cast<int>(sizeof(_Py_CODEUNIT));
        ++e.depth;
      }
      f = f->previous;
    }
    PyGILState_Release(gil);
  }

  void track(Entry& e, const c10::intrusive_ptr<c10d::Work>& w) {
    std::lock_guard<std::mutex> g(last_mu_);
    last_work_ = w;
    last_entry_ = &e;
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  std::vector<Entry> ring_;
  bool stacks_;
  std::atomic<int64_t> count_{0};
  int64_t seq_ = 0;
  std::mutex last_mu_;
  c10::intrusive_ptr<c10d::Work> last_work_;
  Entry* last_entry_ = nullptr;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<RecordingBackend, c10d::Backend, c10::intrusive_ptr<RecordingBackend>>(
      m, "RecordingBackend")
      .def("count", &RecordingBackend::count)
      .def("poll", &RecordingBackend::poll, py::call_guard<py::gil_scoped_release>())
      .def("seqs", &RecordingBackend::seqs)
      .def("frames_of", &RecordingBackend::frames_of);
  m.def("wrap",
        [](c10::intrusive_ptr<c10d::Backend> inner, int64_t capacity, bool stacks) {
          return c10::make_intrusive<RecordingBackend>(std::move(inner), capacity, stacks);
        });
}
