// Makes ring_attention._C importable; loading it registers the operators.
// One plain function besides: cpu_tile_path(dtype, head_dim, scale), the CPU
// kernels' tile path for such a call (csrc/cpu/tile_path.h), for tests and
// benchmarks.
#include <Python.h>
#include <c10/util/Exception.h>

#include <string>

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

PyMethodDef methods[] = {
    {"cpu_tile_path", cpu_tile_path, METH_VARARGS,
     "cpu_tile_path(dtype: str, head_dim: int, scale: float) -> str: the CPU kernels' tile path "
     "for such a call under the current RING_ATTENTION_CPU_* settings."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
