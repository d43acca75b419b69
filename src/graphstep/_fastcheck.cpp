// The guards' per-replay pass over many tensors, in one C++ loop (see fastcheck.py).
//
// From Python, reading one tensor's data pointer or requires_grad costs 50-70 ns (an attribute
// call through torch's argument and __torch_function__ checks), so 1,000 parameters cost more
// than 100 us per replay. Here the same reads are a few ns each. Semantics are those of the
// pure-Python path in guards.py: the tensors' data pointers, and the parameters' requires_grad,
// are what they were when the check was made.

// Only the headers it needs (not torch/extension.h): it compiles in about half the time.
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <vector>

namespace py = pybind11;

namespace {

class TensorCheck {
 public:
  TensorCheck(const py::list& tensors, const py::list& requiring, const py::list& frozen)
      : keep_(py::make_tuple(tensors, requiring, frozen)) {
    for (const auto& h : tensors) {
      tensors_.push_back(h.ptr());
      ptrs_.push_back(THPVariable_Unpack(h.ptr()).data_ptr());
    }
    for (const auto& h : requiring) {
      requiring_.push_back(h.ptr());
    }
    for (const auto& h : frozen) {
      frozen_.push_back(h.ptr());
    }
  }

  bool holds() const {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (THPVariable_Unpack(tensors_[i]).data_ptr() != ptrs_[i]) {
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
  py::tuple keep_;  // strong references: the borrowed pointers below stay valid
  std::vector<PyObject*> tensors_;
  std::vector<const void*> ptrs_;
  std::vector<PyObject*> requiring_;
  std::vector<PyObject*> frozen_;
};

// An optimizer's per-parameter state as a graph captured it (see optim_guard.py): the same state
// dict per parameter, in the same order, holding the same value objects. Compared by identity,
// walking the dicts with PyDict_Next: no tensor is hashed, nothing is allocated.
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
  }

  bool holds() const {
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

 private:
  py::list keep_;
  py::list kept_;
  std::vector<PyObject*> states_;
  std::vector<Py_ssize_t> sizes_;
  std::vector<PyObject*> entries_;  // key, inner dict, key, inner dict, ...
  std::vector<Py_ssize_t> inner_sizes_;
  std::vector<PyObject*> values_;
};

}  // namespace

#ifndef GRAPHSTEP_TORCH_VERSION
#define GRAPHSTEP_TORCH_VERSION "unknown"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The torch it was compiled against: fastcheck.py refuses it under any other (its ABI may differ).
  m.attr("torch_version") = GRAPHSTEP_TORCH_VERSION;
  py::class_<TensorCheck>(m, "TensorCheck")
      .def(py::init<const py::list&, const py::list&, const py::list&>())
      .def("holds", &TensorCheck::holds);
  py::class_<StateCheck>(m, "StateCheck")
      .def(py::init<const py::list&>())
      .def("holds", &StateCheck::holds);
}
