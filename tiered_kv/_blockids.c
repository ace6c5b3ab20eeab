/* A block table's checks in one pass, without a Python step per block id.
 *
 * Every store and load checks the GPU block ids it is given (tiered_kv.arguments): each
 * an integer, inside the registered KV cache, none named twice. Done with Python's
 * min(), max(), set() and a generator over the types, a 16-chunk call of 4 blocks per
 * chunk spent about 5 us on them; scan() takes a few hundred ns. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* A table this long or shorter finds its repeats in a set on the stack. */
#define STACK_IDS 256

/* Whether ``value`` was in the open-addressing set ``ids`` (``used`` marks its filled
 * places, ``mask`` + 1 of them, a power of two at least twice the values put in); it is
 * afterwards. */
static int
seen_before(long *ids, unsigned char *used, size_t mask, long value)
{
    size_t at = (size_t)(((unsigned long long)value * 0x9E3779B97F4A7C15ull) >> 17) & mask;
    while (used[at]) {
        if (ids[at] == value)
            return 1;
        at = (at + 1) & mask;
    }
    used[at] = 1;
    ids[at] = value;
    return 0;
}

/* scan(table, stop): ``None`` unless ``table`` is a list whose items are all exactly
 * ``int`` and each fits a C long; else (lowest, highest, distinct) of ``table[:stop]``,
 * ``stop`` clipped to the list, and ``(0, -1, True)`` when that is empty. */
static PyObject *
scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "scan() takes a table and a stop");
        return NULL;
    }
    Py_ssize_t stop = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (stop == -1 && PyErr_Occurred())
        return NULL;
    if (stop < 0) {
        PyErr_SetString(PyExc_ValueError, "scan() takes a stop of at least 0");
        return NULL;
    }
    PyObject *table = args[0];
    if (!PyList_CheckExact(table))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(table);
    if (stop > n)
        stop = n;
    size_t places = 2;
    while (places < 2 * (size_t)stop)
        places *= 2;
    long stack_ids[2 * STACK_IDS];
    unsigned char stack_used[2 * STACK_IDS];
    long *ids = stack_ids;
    unsigned char *used = stack_used;
    if (places > 2 * STACK_IDS) {
        ids = PyMem_Malloc(places * sizeof(long));
        used = PyMem_Calloc(places, 1);
        if (ids == NULL || used == NULL) {
            PyMem_Free(ids);
            PyMem_Free(used);
            return PyErr_NoMemory();
        }
    } else {
        memset(used, 0, places);
    }
    long lo = 0, hi = -1;
    int distinct = 1, simple = 1;
    /* No Python code runs in the loop (the items are exact ints), so the list cannot change. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(table, i);
        int overflow = 0;
        long value = PyLong_CheckExact(item) ? PyLong_AsLongAndOverflow(item, &overflow) : 0;
        if (!PyLong_CheckExact(item) || overflow) {
            simple = 0;
            break;
        }
        if (i >= stop)
            continue;
        if (i == 0 || value < lo)
            lo = value;
        if (i == 0 || value > hi)
            hi = value;
        if (distinct && seen_before(ids, used, places - 1, value))
            distinct = 0;
    }
    if (ids != stack_ids) {
        PyMem_Free(ids);
        PyMem_Free(used);
    }
    if (!simple)
        Py_RETURN_NONE;
    return Py_BuildValue("(llO)", lo, hi, distinct ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(table, stop): (lowest, highest, distinct) of table[:stop], or None unless table is a list of ints"},
    {NULL, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tiered_kv._blockids",
    .m_doc = "A block table's checks in one pass (tiered_kv.arguments).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__blockids(void)
{
    return PyModule_Create(&module);
}
