/* frforensics.recorder._fastframes: the recorder's stack walk without frame objects.
 *
 * The pure-Python walk (_ring.capture_stack) follows f_back, and CPython 3.11
 * materializes a PyFrameObject for every interpreter frame it reaches that has
 * none yet (~150-250 ns each). This walks the thread's _PyInterpreterFrame chain
 * directly and makes the same decisions:
 *
 *   walk(skip, depth, flt) == _ring.capture_stack(sys._getframe(skip), depth, flt)
 *   as seen from the Python function that calls walk()
 *
 * i.e. [code, lasti, code, lasti, ...] of up to `depth` kept frames, innermost
 * first, where lasti is f_lasti (bytecode offset in bytes, -1 before the first
 * instruction) and a frame is kept when id(code) is in flt.keep_ids, or when it is
 * in neither flt.keep_ids nor flt.skip_ids and flt.keep(code) says so (first
 * sighting: the Python filter classifies it and remembers the verdict). The
 * verdict is then cached on the code object, tagged with flt.serial.
 *
 * CPython 3.11 only: the interpreter-frame layout is internal and changes in every
 * minor version. On any other version this file does not compile (setup.py marks
 * the extension optional, and does not even try outside CPython 3.11), and the
 * recorder uses the pure-Python walk.
 *
 * Safety: every frame walked is live on this thread's call stack below the
 * caller (it is waiting on us), so it outlives the walk even while flt.keep runs
 * Python code. Returned code objects are new references held by the list. The
 * walk stops after MAX_WALK frames, and an empty or too-shallow stack gives [].
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(PYPY_VERSION) || defined(Py_LIMITED_API) || !defined(PY_VERSION_HEX) \
    || PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030C0000
#error "frforensics.recorder._fastframes supports CPython 3.11 only (pure-Python walk elsewhere)"
#endif

#define Py_BUILD_CORE 1
#include "internal/pycore_frame.h"
#undef Py_BUILD_CORE

/* Frames examined (skipped ones included) before the walk gives up. */
#define MAX_WALK 256

static PyObject *str_keep_ids;
static PyObject *str_skip_ids;
static PyObject *str_keep;
static PyObject *str_serial;

/* 1 keep, 0 skip, -1 error. */
static int
verdict(PyObject *flt, PyObject *keep_ids, PyObject *skip_ids, PyCodeObject *code)
{
    PyObject *cid = PyLong_FromVoidPtr((void *)code);
    if (cid == NULL) {
        return -1;
    }
    int keep = PySet_Contains(keep_ids, cid);
    if (keep == 0) {
        int skipped = PySet_Contains(skip_ids, cid);
        if (skipped > 0) {
            keep = 0;
        }
        else if (skipped < 0) {
            keep = -1;
        }
        else {
            /* First sighting: the Python filter decides and remembers. */
            Py_INCREF(code);
            PyObject *res = PyObject_CallMethodOneArg(flt, str_keep, (PyObject *)code);
            Py_DECREF(code);
            if (res == NULL) {
                keep = -1;
            }
            else {
                keep = PyObject_IsTrue(res);
                Py_DECREF(res);
            }
        }
    }
    Py_DECREF(cid);
    return keep;
}

/* Verdicts are also cached on each code object (co_extra, PEP 523's per-code
 * slot), tagged with the filter's serial: a hit costs one array read instead of an
 * int allocation and two set lookups. A new filter, or one that forgot its
 * verdicts, has a new serial, so stale tags never match. */
static Py_ssize_t extra_index = -1;

static PyObject *
walk(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "walk(skip, depth, flt) takes exactly 3 arguments");
        return NULL;
    }
    Py_ssize_t skip = PyLong_AsSsize_t(args[0]);
    if (skip == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t depth = PyLong_AsSsize_t(args[1]);
    if (depth == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (depth <= 0) {
        return PyList_New(0);
    }
    if (depth > MAX_WALK) {
        depth = MAX_WALK;
    }
    PyObject *flt = args[2];
    PyObject *serial_obj = PyObject_GetAttr(flt, str_serial);
    if (serial_obj == NULL) {
        return NULL;
    }
    size_t serial = PyLong_AsSize_t(serial_obj);
    Py_DECREF(serial_obj);
    if (serial == (size_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    void *tag_keep = (void *)(uintptr_t)((serial << 2) | 3u);
    void *tag_skip = (void *)(uintptr_t)((serial << 2) | 1u);
    PyObject *keep_ids = NULL; /* fetched on the first cache miss only */
    PyObject *skip_ids = NULL;
    PyCodeObject *codes[MAX_WALK];
    long offsets[MAX_WALK];
    Py_ssize_t n = 0;

    PyThreadState *tstate = PyThreadState_Get();
    _PyInterpreterFrame *frame = tstate->cframe->current_frame;
    /* The caller's frame is current (a C function pushes none). Skip like
     * sys._getframe(skip): incomplete frames (still being set up) do not count. */
    while (frame != NULL && skip > 0) {
        frame = frame->previous;
        if (frame != NULL && _PyFrame_IsIncomplete(frame)) {
            continue;
        }
        skip--;
    }
    int examined = 0;
    while (frame != NULL && examined < MAX_WALK && n < depth) {
        if (_PyFrame_IsIncomplete(frame)) { /* f_back passes over these too */
            frame = frame->previous;
            continue;
        }
        examined++;
        PyCodeObject *code = frame->f_code;
        void *extra = NULL;
        int keep;
        if (_PyCode_GetExtra((PyObject *)code, extra_index, &extra) < 0) {
            goto error;
        }
        if (extra == tag_keep) {
            keep = 1;
        }
        else if (extra == tag_skip) {
            keep = 0;
        }
        else {
            if (keep_ids == NULL) {
                keep_ids = PyObject_GetAttr(flt, str_keep_ids);
                skip_ids = keep_ids == NULL ? NULL : PyObject_GetAttr(flt, str_skip_ids);
                if (skip_ids == NULL) {
                    goto error;
                }
                if (!PyAnySet_Check(keep_ids) || !PyAnySet_Check(skip_ids)) {
                    PyErr_SetString(PyExc_TypeError,
                                    "flt.keep_ids and flt.skip_ids must be sets");
                    goto error;
                }
            }
            keep = verdict(flt, keep_ids, skip_ids, code);
            if (keep < 0) {
                goto error;
            }
            /* The filter may have forgotten everything (its limit) and taken a
             * new serial meanwhile: tag with the serial it has now. */
            serial_obj = PyObject_GetAttr(flt, str_serial);
            if (serial_obj == NULL) {
                goto error;
            }
            size_t now = PyLong_AsSize_t(serial_obj);
            Py_DECREF(serial_obj);
            if (now == (size_t)-1 && PyErr_Occurred()) {
                goto error;
            }
            if (now == serial &&
                _PyCode_SetExtra((PyObject *)code, extra_index, keep ? tag_keep : tag_skip) < 0) {
                goto error;
            }
        }
        if (keep) {
            int lasti = _PyInterpreterFrame_LASTI(frame);
            codes[n] = code;
            offsets[n] = lasti < 0 ? -1L : (long)lasti * (long)sizeof(_Py_CODEUNIT);
            n++;
        }
        frame = frame->previous;
    }
    Py_XDECREF(keep_ids);
    Py_XDECREF(skip_ids);
    keep_ids = skip_ids = NULL;
    /* Every code in codes[] is still held by its live frame: no Python code ran
     * since the last filter call that could have ended one. */
    PyObject *out = PyList_New(2 * n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *offset = PyLong_FromLong(offsets[i]);
        if (offset == NULL) {
            Py_DECREF(out); /* unfilled slots are NULL: list dealloc skips them */
            return NULL;
        }
        Py_INCREF(codes[i]);
        PyList_SET_ITEM(out, 2 * i, (PyObject *)codes[i]);
        PyList_SET_ITEM(out, 2 * i + 1, offset);
    }
    /* Only code objects and ints: no cycle can go through it (see untrack). */
    PyObject_GC_UnTrack(out);
    return out;

error:
    Py_XDECREF(keep_ids);
    Py_XDECREF(skip_ids);
    return NULL;
}

/* untrack(obj) -> obj: take a container out of the cyclic GC's lists.
 *
 * The ring holds 2000 entry lists (and their stack lists) for as long as the job
 * runs; tracked, every young collection a training loop's allocations trigger
 * walks the new ones and promotes them, and every older collection walks them
 * all (measured: +5 us of GC per op under allocation churn, docs/recorder.md).
 * An entry holds only ints, strings, tuples, torch objects and its stack list,
 * and nothing refers back to it but the ring and the watchdog's queue: it can
 * never be part of a reference cycle, so reference counting alone frees it and
 * the GC has nothing to find in it. Untracked, it still keeps what it refers to
 * alive (it is an outside reference to the collector). The tuples it holds (the
 * tensors' shapes and dtypes, made by the recorder from each op) are untracked
 * with it, three levels down. */
static void
untrack_tuples(PyObject *obj, int depth)
{
    /* The entry's shape/dtype metadata: tuples (and torch.Size, a tuple subclass)
     * we made from the op's tensors, holding ints, dtypes and more such tuples. */
    if (depth > 3 || !PyTuple_Check(obj)) {
        return;
    }
    if (PyObject_GC_IsTracked(obj)) {
        PyObject_GC_UnTrack(obj);
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); i++) {
        untrack_tuples(PyTuple_GET_ITEM(obj, i), depth + 1);
    }
}

static PyObject *
untrack(PyObject *Py_UNUSED(module), PyObject *obj)
{
    if (PyObject_IS_GC(obj) && PyObject_GC_IsTracked(obj)) {
        PyObject_GC_UnTrack(obj);
    }
    if (PyList_Check(obj)) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(obj); i++) {
            untrack_tuples(PyList_GET_ITEM(obj, i), 0);
        }
    }
    Py_INCREF(obj);
    return obj;
}

static PyMethodDef methods[] = {
    {"untrack", (PyCFunction)untrack, METH_O,
     "untrack(obj) -> obj\n\nTake a container that can never be in a reference cycle out of\n"
     "the cyclic GC (the ring's entries)."},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "walk(skip, depth, flt) -> [code, lasti, ...]\n\n"
     "The same list as capture_stack(sys._getframe(skip), depth, flt) called where\n"
     "walk is called, without materializing frame objects."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "frforensics.recorder._fastframes",
    "The recorder's stack walk over CPython 3.11 interpreter frames (optional).",
    -1,
    methods,
};

PyMODINIT_FUNC
PyInit__fastframes(void)
{
    /* Built against one 3.11 and loaded by another minor version is impossible
     * (the ABI tag is in the file name), but refuse anything but 3.11 anyway. */
    if ((Py_Version >> 16) != 0x030B) {
        PyErr_SetString(PyExc_ImportError, "_fastframes needs CPython 3.11");
        return NULL;
    }
    str_keep_ids = PyUnicode_InternFromString("keep_ids");
    str_skip_ids = PyUnicode_InternFromString("skip_ids");
    str_keep = PyUnicode_InternFromString("keep");
    str_serial = PyUnicode_InternFromString("serial");
    if (str_keep_ids == NULL || str_skip_ids == NULL || str_keep == NULL || str_serial == NULL) {
        return NULL;
    }
    extra_index = _PyEval_RequestCodeExtraIndex(NULL);
    if (extra_index < 0) {
        PyErr_SetString(PyExc_ImportError, "_fastframes: no code-object extra slot left");
        return NULL;
    }
    return PyModule_Create(&module);
}
