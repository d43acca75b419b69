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
}
