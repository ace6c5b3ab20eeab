/* A block table's checks in one pass, without a Python step per block id.
 *
 * Every store and load checks the GPU block ids it is given (tiered_kv.arguments): each
 * an integer, inside the registered KV cache, none named twice. Done with Python's
 * min(), max(), set() and a generator over the types, a 16-chunk call of 4 blocks per
 * chunk spent about 5 us on them; scan() takes a few hundred ns, and O(n log n) at worst
 * (ids crafted to collide in its set are sorted instead). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* A table this long or shorter is checked with buffers on the stack. */
#define STACK_IDS 256

static int
compare_ids(const void *a, const void *b)
{
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}

/* Whether ``ids[0:n]`` holds a value twice. An open-addressing set (``places``, a power of
 * two at least 2n, with ``slots`` and ``used`` of that size) finds repeats in O(n) for the
 * ids an engine hands out; ids chosen to collide in its fixed hash would make that
 * O(n^2), so past a budget of probes it sorts ``ids`` instead: O(n log n) at worst. */
static int
has_repeat(long *ids, Py_ssize_t n, long *slots, unsigned char *used, size_t places)
{
    size_t mask = places - 1, budget = 8 * (size_t)n + 64;
    memset(used, 0, places);
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t at = (size_t)(((unsigned long long)ids[i] * 0x9E3779B97F4A7C15ull) >> 17) & mask;
        while (used[at]) {
            if (slots[at] == ids[i])
                return 1;
            if (budget-- == 0)
                goto sort;
            at = (at + 1) & mask;
        }
        used[at] = 1;
        slots[at] = ids[i];
    }
    return 0;
sort:
    qsort(ids, (size_t)n, sizeof(long), compare_ids);
    for (Py_ssize_t i = 1; i < n; i++)
        if (ids[i] == ids[i - 1])
            return 1;
    return 0;
}

/* scan(table, stop, repeats): ``None`` unless ``table`` is a list whose items are all
 * exactly ``int`` and each fits a C long; else (lowest, highest, distinct) of
 * ``table[:stop]``, ``stop`` clipped to the list, and ``(0, -1, True)`` when that is
 * empty. ``distinct`` is ``None`` unless ``repeats`` asked for it. */
static PyObject *
scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "scan() takes a table, a stop and whether to look for repeats");
        return NULL;
    }
    Py_ssize_t stop = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (stop == -1 && PyErr_Occurred())
        return NULL;
    if (stop < 0) {
        PyErr_SetString(PyExc_ValueError, "scan() takes a stop of at least 0");
        return NULL;
    }
    int repeats = PyObject_IsTrue(args[2]);
    if (repeats < 0)
        return NULL;
    PyObject *table = args[0];
    if (!PyList_CheckExact(table))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(table);
    if (stop > n)
        stop = n;
    size_t places = 2;
    while (places < 2 * (size_t)stop)
        places *= 2;
    long stack_ids[STACK_IDS], stack_slots[2 * STACK_IDS];
    unsigned char stack_used[2 * STACK_IDS];
    long *ids = stack_ids, *slots = stack_slots;
    unsigned char *used = stack_used;
    if (repeats && stop > STACK_IDS) {
        ids = PyMem_Malloc((size_t)stop * sizeof(long));
        slots = PyMem_Malloc(places * sizeof(long));
        used = PyMem_Malloc(places);
        if (ids == NULL || slots == NULL || used == NULL) {
            PyMem_Free(ids);
            PyMem_Free(slots);
            PyMem_Free(used);
            return PyErr_NoMemory();
        }
    }
    long lo = 0, hi = -1;
    int simple = 1;
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
        if (repeats)
            ids[i] = value;
    }
    int distinct = simple && repeats ? !has_repeat(ids, stop, slots, used, places) : 1;
    if (ids != stack_ids) {
        PyMem_Free(ids);
        PyMem_Free(slots);
        PyMem_Free(used);
    }
    if (!simple)
        Py_RETURN_NONE;
    return Py_BuildValue("(llO)", lo, hi, !repeats ? Py_None : distinct ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(table, stop, repeats): (lowest, highest, distinct or None) of table[:stop], or None unless table is a "
     "list of ints"},
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
