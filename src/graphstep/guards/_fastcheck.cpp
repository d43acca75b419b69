// graphstep's C++ helper (see fastcheck.py): the guards' per-replay passes over many tensors and
// dicts, each one C++ loop; at the end, the call key and the output ring of a replay's hot path.
//
// From Python, reading one tensor's data pointer or requires_grad costs 50-70 ns (an attribute
// call through torch's argument and __torch_function__ checks), so 1,000 parameters cost more
// than 100 us per replay. Here the same reads are a few ns each. Semantics are those of the
// pure-Python path in guards.py: the tensors' data pointers, and the parameters' requires_grad,
// are what they were when the check was made.

// Only the headers it needs (not torch/extension.h): it compiles in about half the time.
// GRAPHSTEP_DICTS_ONLY builds the dict checks alone, without torch (to test them on other Pythons).
#include <pybind11/pybind11.h>
#ifndef GRAPHSTEP_DICTS_ONLY
#include <ATen/ops/from_blob.h>
#include <torch/csrc/autograd/python_variable.h>
#endif

#include <algorithm>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

#ifndef GRAPHSTEP_DICTS_ONLY
class TensorCheck {
 public:
  TensorCheck(const py::list& tensors, const py::list& requiring, const py::list& frozen)
      : keep_(py::make_tuple(tensors, requiring, frozen)) {
    // Most tensors checked are parameters: their requires_grad is read in the same pass, from
    // the tensor already at hand; the others get passes of their own.
    std::unordered_map<PyObject*, Grad> wanted;
    for (const auto& h : requiring) wanted.emplace(h.ptr(), Grad::kRequired);
    for (const auto& h : frozen) wanted.emplace(h.ptr(), Grad::kFrozen);
    for (const auto& h : tensors) {
      tensors_.push_back(h.ptr());
      ptrs_.push_back(THPVariable_Unpack(h.ptr()).data_ptr());
      auto found = wanted.find(h.ptr());
      grads_.push_back(found == wanted.end() ? Grad::kAny : found->second);
      if (found != wanted.end()) wanted.erase(found);
    }
    for (const auto& h : requiring) {
      if (wanted.count(h.ptr())) requiring_.push_back(h.ptr());
    }
    for (const auto& h : frozen) {
      if (wanted.count(h.ptr())) frozen_.push_back(h.ptr());
    }
  }

  bool holds() const {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const at::Tensor& t = THPVariable_Unpack(tensors_[i]);
      if (t.data_ptr() != ptrs_[i]) {
        return false;
      }
      if (grads_[i] != Grad::kAny && t.requires_grad() != (grads_[i] == Grad::kRequired)) {
        return false;
      }
    }
    for (PyObject* p : requiring_) {
      if (!THPVariable_Unpack(p).requires_grad()) {
        return false;
      }
    }
    for (PyObject* p : frozen_) {
      if (THPVariable_Unpack(p).requires_grad()) {
        return false;
      }
    }
    return true;
  }

 private:
  enum class Grad : char { kAny, kRequired, kFrozen };
  py::tuple keep_;  // strong references: the borrowed pointers below stay valid
  std::vector<PyObject*> tensors_;
  std::vector<const void*> ptrs_;
  std::vector<Grad> grads_;  // per tensor: what its requires_grad must be
  std::vector<PyObject*> requiring_;  // parameters not among tensors_
  std::vector<PyObject*> frozen_;
};
#endif  // GRAPHSTEP_DICTS_ONLY

// A write barrier for dicts, from Python 3.12 on (PEP 699's dict watchers): every change to a
// watched dict (set, delete, clear, update, pop, ...) counts one event. A check that watches the
// dicts it compares needs no walk while no event happened since it last held. Dicts stay watched
// for their lifetime (unwatching one might blind another check that watches it too).
class DictWatch;
// Which DictWatch objects watch a dict, by the dict's address. Allocated once and never freed: a
// dict event can come during interpreter shutdown, after static destructors ran.
auto& watchers_of = *new std::unordered_map<PyObject*, std::vector<DictWatch*>>();
[[maybe_unused]] void mark_changed(DictWatch* watch);

#if PY_VERSION_HEX >= 0x030C0000
constexpr bool kWatchesDicts = true;
int dict_watcher = -2;  // -2: not asked for yet; -1: none to be had (all watcher ids taken)
unsigned long long dict_events = 0;

int count_dict_event(PyDict_WatchEvent, PyObject* dict, PyObject*, PyObject*) {
  ++dict_events;
  auto found = watchers_of.find(dict);
  if (found != watchers_of.end()) {
    for (DictWatch* w : found->second) mark_changed(w);
  }
  return 0;
}

bool watch(PyObject* dict) {
  if (dict_watcher == -2) {
    dict_watcher = PyDict_AddWatcher(count_dict_event);
    if (dict_watcher < 0) {
      PyErr_Clear();
      dict_watcher = -1;
    }
  }
  if (dict_watcher < 0 || PyDict_Watch(dict_watcher, dict) < 0) {
    PyErr_Clear();
    return false;
  }
  return true;
}
#else
constexpr bool kWatchesDicts = false;
unsigned long long dict_events = 0;

bool watch(PyObject*) { return false; }
#endif

// An optimizer's per-parameter state as a graph captured it (see optim_guard.py): the same state
// dict per parameter, in the same order, holding the same value objects. Compared by identity,
// walking the dicts with PyDict_Next: no tensor is hashed, nothing is allocated. Where dicts can
// be watched, the walk runs only after some watched dict changed.
class StateCheck {
 public:
  explicit StateCheck(const py::list& states) : keep_(states) {
    for (const auto& h : states) {
      PyObject* state = h.ptr();
      states_.push_back(state);
      sizes_.push_back(PyDict_Size(state));
      Py_ssize_t pos = 0;
      PyObject *key, *inner;
      while (PyDict_Next(state, &pos, &key, &inner)) {
        entries_.push_back(key);
        entries_.push_back(inner);
        if (!PyDict_Check(inner)) {
          throw py::type_error("optimizer state entries must be dicts");
        }
        inner_sizes_.push_back(PyDict_Size(inner));
        Py_ssize_t ipos = 0;
        PyObject *ikey, *value;
        while (PyDict_Next(inner, &ipos, &ikey, &value)) {
          values_.push_back(value);
        }
      }
    }
    // Strong references to everything compared: an address compared is never a freed object's.
    py::list kept;
    for (PyObject* o : entries_) kept.append(py::reinterpret_borrow<py::object>(o));
    for (PyObject* o : values_) kept.append(py::reinterpret_borrow<py::object>(o));
    kept_ = kept;
    watched_ = true;
    for (PyObject* state : states_) watched_ = watch(state) && watched_;
    for (size_t i = 1; i < entries_.size(); i += 2) watched_ = watch(entries_[i]) && watched_;
    seen_events_ = dict_events;
  }

  bool holds() const {
    if (watched_ && seen_events_ == dict_events) {
      return true;  // no watched dict changed since the last walk that held
    }
    const unsigned long long events = dict_events;
    ++walks_;
    if (!walk()) {
      return false;
    }
    seen_events_ = events;
    return true;
  }

  unsigned long long walks() const { return walks_; }

 private:
  bool walk() const {
    size_t entry = 0, inner_index = 0, value = 0;
    for (size_t s = 0; s < states_.size(); ++s) {
      PyObject* state = states_[s];
      if (PyDict_Size(state) != sizes_[s]) {
        return false;
      }
      Py_ssize_t pos = 0;
      PyObject *key, *inner;
      while (PyDict_Next(state, &pos, &key, &inner)) {
        if (key != entries_[entry] || inner != entries_[entry + 1] ||
            PyDict_Size(inner) != inner_sizes_[inner_index]) {
          return false;
        }
        entry += 2;
        ++inner_index;
        Py_ssize_t ipos = 0;
        PyObject *ikey, *item;
        while (PyDict_Next(inner, &ipos, &ikey, &item)) {
          if (item != values_[value++]) {
            return false;
          }
        }
      }
    }
    return true;
  }

  py::list keep_;
  py::list kept_;
  bool watched_ = false;
  mutable unsigned long long seen_events_ = 0;
  mutable unsigned long long walks_ = 0;  // walks by holds(), for tests: none while nothing changed
  std::vector<PyObject*> states_;
  std::vector<Py_ssize_t> sizes_;
  std::vector<PyObject*> entries_;  // key, inner dict, key, inner dict, ...
  std::vector<Py_ssize_t> inner_sizes_;
  std::vector<PyObject*> values_;
};

// The dicts one guard compares (see contents.py), and whether any of them changed since `clear()`:
// a replay after no change asks one flag instead of comparing their entries. Where dicts cannot be
// watched (before Python 3.12, or no watcher id left), `watch()` says so and the caller compares.
class DictWatch {
 public:
  DictWatch() = default;
  DictWatch(const DictWatch&) = delete;
  DictWatch& operator=(const DictWatch&) = delete;
  ~DictWatch() {
    for (PyObject* d : dicts_) {
      auto found = watchers_of.find(d);
      if (found == watchers_of.end()) continue;
      auto& list = found->second;
      list.erase(std::remove(list.begin(), list.end(), this), list.end());
      if (list.empty()) watchers_of.erase(found);
    }
  }

  bool watch_dict(const py::object& d) {
    if (!PyDict_Check(d.ptr()) || !watch(d.ptr())) {
      return false;
    }
    if (std::find(dicts_.begin(), dicts_.end(), d.ptr()) == dicts_.end()) {
      keep_.append(d);  // a strong reference: the address stays this dict's while watched
      dicts_.push_back(d.ptr());
      watchers_of[d.ptr()].push_back(this);
    }
    return true;
  }

  bool changed() const { return changed_; }
  void clear() { changed_ = false; }
  void set_changed() { changed_ = true; }

 private:
  py::list keep_;
  std::vector<PyObject*> dicts_;
  bool changed_ = false;
};

void mark_changed(DictWatch* watch) { watch->set_changed(); }

// The identity pass of a guard's common replay (see fastcheck.identity_check): every binding,
// attribute, container item and dict entry a guard compares is still the object it saw, and the
// guard's own checks (calls) answer as when it held. Any difference answers false and the caller
// takes its Python path, which tells a real change from an equal value rebound: this pass only
// spares the Python loops when nothing changed.
class IdentityCheck {
 public:
  enum Kind : int { kItem = 0, kCell, kAttr, kItems, kDict, kTrue, kFalse };

  IdentityCheck(const py::list& entries, const py::object& missing) : keep_(entries), missing_(missing) {
    for (const auto& h : entries) {
      auto t = h.cast<py::tuple>();
      if (t.size() != 4) throw py::value_error("identity entries are (kind, a, b, c)");
      Entry e{static_cast<Kind>(t[0].cast<int>()), t[1].ptr(), t[2].ptr(), t[3].ptr()};
      if (e.kind < kItem || e.kind > kFalse) throw py::value_error("unknown identity entry kind");
      if (e.kind == kItem || e.kind == kDict) {
        if (!PyDict_Check(e.a)) throw py::type_error("an item or dict entry needs a dict");
      }
      if (e.kind == kCell && !PyCell_Check(e.a)) throw py::type_error("a cell entry needs a cell");
      if ((e.kind == kItems || e.kind == kDict) && !PyTuple_Check(e.b)) {
        throw py::type_error("expected items must be a tuple");
      }
      if (e.kind == kDict && (!PyTuple_Check(e.c) || PyTuple_GET_SIZE(e.b) != PyTuple_GET_SIZE(e.c))) {
        throw py::type_error("a dict entry needs keys and values of one length");
      }
      entries_.push_back(e);
    }
  }

  bool holds() const {
    for (const Entry& e : entries_) {
      if (!entry_holds(e)) {
        if (PyErr_Occurred()) PyErr_Clear();  // the Python path meets it again and reports it
        return false;
      }
    }
    return true;
  }

 private:
  struct Entry {
    Kind kind;
    PyObject* a;  // borrowed: keep_ holds every tuple
    PyObject* b;
    PyObject* c;
  };

  bool entry_holds(const Entry& e) const {
    switch (e.kind) {
      case kItem: {
        PyObject* now = PyDict_GetItemWithError(e.a, e.b);
        if (now == nullptr && PyErr_Occurred()) return false;
        return (now != nullptr ? now : missing_.ptr()) == e.c;
      }
      case kCell: {
        PyObject* now = PyCell_GET(e.a);
        return now != nullptr && now == e.b;
      }
      case kAttr: {
        PyObject* now = PyObject_GetAttr(e.a, e.b);
        if (now == nullptr) {
          if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return false;
          PyErr_Clear();
          return missing_.ptr() == e.c;
        }
        const bool same = now == e.c;
        Py_DECREF(now);
        return same;
      }
      case kItems:
        return items_hold(e.a, e.b);
      case kDict:
        return dict_holds(e.a, e.b, e.c);
      case kTrue:
      case kFalse: {
        PyObject* answer = PyObject_CallNoArgs(e.a);
        if (answer == nullptr) return false;
        const bool same = answer == (e.kind == kTrue ? Py_True : Py_False);
        Py_DECREF(answer);
        return same;
      }
    }
    return false;
  }

  // A list, deque or set: the same objects in the same order.
  static bool items_hold(PyObject* container, PyObject* expected) {
    const Py_ssize_t n = PyTuple_GET_SIZE(expected);
    if (PyList_CheckExact(container)) {
      if (PyList_GET_SIZE(container) != n) return false;
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (PyList_GET_ITEM(container, i) != PyTuple_GET_ITEM(expected, i)) return false;
      }
      return true;
    }
    if (PyObject_Length(container) != n) return false;
    PyObject* it = PyObject_GetIter(container);
    if (it == nullptr) return false;
    bool same = true;
    for (Py_ssize_t i = 0; same && i < n; ++i) {
      PyObject* item = PyIter_Next(it);
      same = item != nullptr && item == PyTuple_GET_ITEM(expected, i);
      Py_XDECREF(item);
    }
    Py_DECREF(it);
    return same && !PyErr_Occurred();
  }

  // A dict guarded whole: the same keys, in the same order, holding the same objects.
  static bool dict_holds(PyObject* d, PyObject* keys, PyObject* values) {
    if (PyDict_Size(d) != PyTuple_GET_SIZE(keys)) return false;
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(d, &pos, &key, &value)) {
      if (key != PyTuple_GET_ITEM(keys, i) || value != PyTuple_GET_ITEM(values, i)) return false;
      ++i;
    }
    return true;
  }

  py::list keep_;
  py::object missing_;
  std::vector<Entry> entries_;
};

#ifndef GRAPHSTEP_DICTS_ONLY
// The tensor arguments of the last call a captured step dispatched: whether a call's positional
// arguments are tensors of the same class (exactly), shapes, strides, dtypes, devices and
// requires_grad, none the same object as another, and no keyword arguments. Then it picks the same
// graph, and building its Signature (signature.py) can be skipped.
class CallKey {
 public:
  explicit CallKey(const py::object& tensor_class) : tensor_class_(tensor_class) {}

  void remember(const py::tuple& args) {
    metas_.clear();
    for (const auto& h : args) {
      const at::Tensor& t = THPVariable_Unpack(h.ptr());
      metas_.push_back(Meta{t.sizes().vec(), t.strides().vec(), t.scalar_type(), t.device(), t.requires_grad()});
    }
  }

  bool matches(const py::tuple& args, const py::dict& kwargs) const {
    PyObject* a = args.ptr();
    const Py_ssize_t n = PyTuple_GET_SIZE(a);
    if (PyDict_GET_SIZE(kwargs.ptr()) != 0 || static_cast<size_t>(n) != metas_.size()) {
      return false;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* o = PyTuple_GET_ITEM(a, i);
      if (reinterpret_cast<PyObject*>(Py_TYPE(o)) != tensor_class_.ptr()) {
        return false;
      }
      for (Py_ssize_t j = 0; j < i; ++j) {
        if (PyTuple_GET_ITEM(a, j) == o) return false;
      }
      const at::Tensor& t = THPVariable_Unpack(o);
      if (t.layout() != c10::kStrided) return false;  // no strides to compare: the Python path decides
      const Meta& m = metas_[i];
      if (t.scalar_type() != m.dtype || t.device() != m.device || t.requires_grad() != m.requires_grad ||
          t.sizes() != c10::IntArrayRef(m.sizes) || t.strides() != c10::IntArrayRef(m.strides)) {
        return false;
      }
    }
    return true;
  }

 private:
  struct Meta {
    std::vector<int64_t> sizes;
    std::vector<int64_t> strides;
    c10::ScalarType dtype;
    c10::Device device;
    bool requires_grad;
  };
  py::object tensor_class_;
  std::vector<Meta> metas_;
};

// The outputs of one graph, handed out without a copy per call (see backends/output_ring.py).
// The graph writes its outputs into slot 0, 1, 0, 1, ... of the ring (its own device flag picks
// the slot); each call hands out tensors over the slot just written, with storages of their own.
// Before a replay writes a slot again, whatever the caller still holds of it (any tensor sharing
// such a storage, views and detached aliases included) is moved to a copy, so a held result never
// changes; a result the caller let go costs nothing.
class OutputRing {
 public:
  // `flag`: the device flag the graph flips each replay, kept alive with the slots (freed, its
  // memory would go to other tensors while the graph still writes it).
  OutputRing(const py::list& slots, const py::object& flag) : flag_(THPVariable_Unpack(flag.ptr())) {
    for (const auto& slot : slots) {
      std::vector<at::Tensor> tensors;
      for (const auto& t : slot.cast<py::list>()) tensors.push_back(THPVariable_Unpack(t.ptr()));
      slots_.push_back(std::move(tensors));
    }
    handed_.resize(slots_.size());
  }

  // Call right before the graph that writes the ring launches.
  void before_replay() {
    written_ = next_;
    next_ = (next_ + 1) % slots_.size();
    auto& handed = handed_[written_];
    for (size_t i = 0; i < handed.size(); ++i) {
      c10::intrusive_ptr<c10::StorageImpl> held = handed[i].lock();
      if (held) move_to_copy(*held, slots_[written_][i]);
    }
    handed.clear();
  }

  // The tensors of the slot the last replay wrote, in new storages over its memory.
  py::list hand_out() {
    py::list out;
    auto& handed = handed_[written_];
    for (const at::Tensor& slot : slots_[written_]) {
      // The storage keeps the slot's memory alive (the deleter holds it) even if the graph goes.
      at::Tensor alias = at::from_blob(
          slot.data_ptr(), slot.sizes(), slot.strides(), [keep = slot.storage()](void*) {},
          slot.options(), slot.device());
      handed.push_back(alias.storage().getWeakStorageImpl());
      out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(alias))));
    }
    return out;
  }

  // Results handed out and moved to a copy because they were still held (for tests).
  long long copies() const { return copies_; }

 private:
  void move_to_copy(c10::StorageImpl& held, const at::Tensor& slot) {
    // Ordered on the slot's current stream, before the replay that overwrites the slot.
    at::Tensor copy = slot.clone(at::MemoryFormat::Contiguous);
    c10::StorageImpl* fresh = copy.storage().unsafeGetStorageImpl();
    TORCH_CHECK(fresh->nbytes() == held.nbytes(), "graphstep: output ring slot of unexpected size");
    held.set_data_ptr_noswap(fresh->set_data_ptr(c10::DataPtr(nullptr, slot.device())));
    ++copies_;
  }

  at::Tensor flag_;
  std::vector<std::vector<at::Tensor>> slots_;  // [slot][output]
  std::vector<std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>> handed_;
  size_t next_ = 0;
  size_t written_ = 0;
  long long copies_ = 0;
};
#endif

}  // namespace

#ifndef GRAPHSTEP_TORCH_VERSION
#define GRAPHSTEP_TORCH_VERSION "unknown"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The torch it was compiled against: fastcheck.py refuses it under any other (its ABI may differ).
  m.attr("torch_version") = GRAPHSTEP_TORCH_VERSION;
  m.attr("watches_dicts") = kWatchesDicts;
#ifndef GRAPHSTEP_DICTS_ONLY
  py::class_<TensorCheck>(m, "TensorCheck")
      .def(py::init<const py::list&, const py::list&, const py::list&>())
      .def("holds", &TensorCheck::holds);
  py::class_<CallKey>(m, "CallKey")
      .def(py::init<const py::object&>())
      .def("remember", &CallKey::remember)
      .def("matches", &CallKey::matches);
  py::class_<OutputRing>(m, "OutputRing")
      .def(py::init<const py::list&, const py::object&>())
      .def("before_replay", &OutputRing::before_replay)
      .def("hand_out", &OutputRing::hand_out)
      .def_property_readonly("copies", &OutputRing::copies);
#endif
  py::class_<DictWatch>(m, "DictWatch")
      .def(py::init<>())
      .def("watch", &DictWatch::watch_dict)
      .def("changed", &DictWatch::changed)
      .def("clear", &DictWatch::clear);
  py::class_<IdentityCheck>(m, "IdentityCheck")
      .def(py::init<const py::list&, const py::object&>())
      .def("holds", &IdentityCheck::holds);
  py::class_<StateCheck>(m, "StateCheck")
      .def(py::init<const py::list&>())
      .def("holds", &StateCheck::holds)
      .def_property_readonly("walks", &StateCheck::walks);
}
