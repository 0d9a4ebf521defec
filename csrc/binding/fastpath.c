/*
 * tpcomm._fastpath: the eager all_reduce of Communicator, one C call from
 * Python into the C core, without the torch dispatcher.
 *
 * Why: a torch op adds dispatch (schema lookup, boxing through the stable
 * ABI) and ctypes adds argument conversion, each comparable to the launch's
 * own host time (benchmarks/host_cost.py measures them; the figures are in
 * docs). Model code and torch.compile keep the torch ops; this path only
 * serves Communicator.all_reduce called eagerly with plain CUDA tensors,
 * 16-byte aligned (the C core refuses others; the torch op copies them).
 *
 * The C core lives in the torch extension (tpcomm._C), loaded by ctypes, so
 * this module does not link against it: bind() takes the addresses of the
 * three C functions it calls, read through ctypes from that same library, so
 * both paths use one registry of communicators.
 *
 * Built against the limited API (3.10+, METH_FASTCALL), like tpcomm._C.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>

#include "../tpcomm.h"

typedef tpc_result (*id_all_reduce_fn)(uint64_t, const void *, void *, size_t, tpc_dtype, tpc_algo, void *);
typedef const char *(*last_error_fn)(const tpc_comm *);
typedef const char *(*result_string_fn)(tpc_result);

static id_all_reduce_fn id_all_reduce;
static last_error_fn last_error;
static result_string_fn result_string;

static void *address(PyObject *o) { return PyLong_AsVoidPtr(o); }

/* bind(tpc_id_all_reduce, tpc_comm_last_error, tpc_result_string): the
 * functions' addresses. */
static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3) return PyErr_Format(PyExc_TypeError, "bind takes 3 addresses, got %zd arguments", nargs);
  void *f = address(args[0]), *g = address(args[1]), *h = address(args[2]);
  if (PyErr_Occurred()) return NULL;
  if (!f || !g || !h) return PyErr_Format(PyExc_ValueError, "bind: NULL function address");
  id_all_reduce = (id_all_reduce_fn)f;
  last_error = (last_error_fn)g;
  result_string = (result_string_fn)h;
  Py_RETURN_NONE;
}

/* all_reduce(comm_id, in_ptr, out_ptr, nbytes, dtype, algo, stream): tpc_all_reduce
 * of comm_id on the raw stream. A failure raises RuntimeError
 * whose message ends in "[tpc_result N]", as the torch ops' errors do
 * (ops.cpp's check), so Python maps both to the same tpcomm exception. */
static PyObject *all_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 7) return PyErr_Format(PyExc_TypeError, "all_reduce takes 7 arguments, got %zd", nargs);
  if (!id_all_reduce) return PyErr_Format(PyExc_RuntimeError, "tpcomm._fastpath: bind() was not called");
  const unsigned long long comm_id = PyLong_AsUnsignedLongLong(args[0]);
  void *in = address(args[1]), *out = address(args[2]);
  const size_t nbytes = PyLong_AsSize_t(args[3]);
  const long dtype = PyLong_AsLong(args[4]), algo = PyLong_AsLong(args[5]);
  void *stream = address(args[6]);
  if (PyErr_Occurred()) return NULL;
  /* the C core checks the codes; one beyond int would be truncated into another */
  if (dtype < INT_MIN || dtype > INT_MAX || algo < INT_MIN || algo > INT_MAX)
    return PyErr_Format(PyExc_ValueError, "all_reduce: dtype %ld or algorithm %ld is not a C enum value", dtype,
                        algo);
  tpc_result r;
  /* the launch never waits for the GPU, but a first call may load modules */
  Py_BEGIN_ALLOW_THREADS
  r = id_all_reduce(comm_id, in, out, nbytes, (tpc_dtype)dtype, (tpc_algo)algo, stream);
  Py_END_ALLOW_THREADS
  if (r != TPC_OK)
    return PyErr_Format(PyExc_RuntimeError, "tpcomm: %s: %s [tpc_result %d]", result_string(r), last_error(NULL),
                        (int)r);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(id_all_reduce, last_error, result_string): C core addresses"},
    {"all_reduce", (PyCFunction)(void (*)(void))all_reduce, METH_FASTCALL,
     "all_reduce(comm_id, in_ptr, out_ptr, nbytes, dtype, algo, stream)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tpcomm._fastpath", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastpath(void) { return PyModule_Create(&module); }
