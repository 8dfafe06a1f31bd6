// Makes ring_attention._C importable; loading it registers the operators.
#include <Python.h>

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
