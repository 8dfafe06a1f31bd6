// Makes ring_attention._C importable; loading it registers the operators.
// Three plain functions besides, for tests and benchmarks: cpu_tile_path(dtype,
// head_dim, scale), the CPU kernels' tile path for such a call
// (csrc/cpu/tile_path.h), cpu_tile_path_runs(), the paths the kernels ran
// (counted by pass), and cpu_avx2_exp_row(buffer, scale, sub), the AVX2
// softmax pass's exponential over a float32 buffer in place (its error
// against float64 is measured by tests/test_cpu_tile_paths.py).
#include <Python.h>
#include <c10/util/Exception.h>

#include <string>

#include "config.h"
#include "cpu/softmax_rows.h"
#include "cpu/tile_path.h"

namespace {

PyObject* cpu_tile_path(PyObject*, PyObject* args) {
  const char* dtype = nullptr;
  long long head_dim = 0;
  double scale = 0;
  if (!PyArg_ParseTuple(args, "sLd", &dtype, &head_dim, &scale)) return nullptr;
  try {
    const std::string name = ring_attention::cpu::describe_path(dtype, head_dim, scale);
    return PyUnicode_FromString(name.c_str());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyObject* cpu_tile_path_runs(PyObject*, PyObject*) {
  PyObject* runs = PyDict_New();
  if (runs == nullptr) return nullptr;
  for (const auto& [name, count] : ring_attention::cpu::path_runs()) {
    PyObject* value = PyLong_FromUnsignedLongLong(count);
    if (value == nullptr || PyDict_SetItemString(runs, name.c_str(), value) != 0) {
      Py_XDECREF(value);
      Py_DECREF(runs);
      return nullptr;
    }
    Py_DECREF(value);
  }
  return runs;
}

PyObject* cpu_avx2_exp_row(PyObject*, PyObject* args) {
  Py_buffer view;
  double scale = 0, sub = 0;
  if (!PyArg_ParseTuple(args, "w*dd", &view, &scale, &sub)) return nullptr;
  PyObject* result = nullptr;
  if (view.itemsize != 4 || view.len % 4 != 0 || !PyBuffer_IsContiguous(&view, 'C')) {
    PyErr_SetString(PyExc_ValueError, "cpu_avx2_exp_row: buffer must be contiguous float32");
  } else if (ring_attention::cpu::machine_isa() < ring_attention::config::CpuIsa::kAvx2) {
    PyErr_SetString(PyExc_RuntimeError, "cpu_avx2_exp_row: this CPU has no AVX2 and FMA");
  } else {
#if defined(__x86_64__)
    const float sum =
        ring_attention::cpu::avx2::exp_row(static_cast<float*>(view.buf), view.len / 4,
                                           static_cast<float>(scale), static_cast<float>(sub));
    result = PyFloat_FromDouble(sum);
#endif
  }
  PyBuffer_Release(&view);
  return result;
}

PyMethodDef methods[] = {
    {"cpu_tile_path", cpu_tile_path, METH_VARARGS,
     "cpu_tile_path(dtype: str, head_dim: int, scale: float) -> str: the CPU kernels' tile path "
     "for such a call under the current RING_ATTENTION_CPU_* settings."},
    {"cpu_tile_path_runs", cpu_tile_path_runs, METH_NOARGS,
     "cpu_tile_path_runs() -> dict[str, int]: how many CPU block calls of this process ran each "
     "tile path, by pass ('forward Bf16Packed/avx512': n); the paths run at least once."},
    {"cpu_avx2_exp_row", cpu_avx2_exp_row, METH_VARARGS,
     "cpu_avx2_exp_row(buffer, scale: float, sub: float) -> float: x = exp(scale * x - sub) on "
     "a contiguous float32 buffer in place with the AVX2 softmax pass; returns the sum."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
