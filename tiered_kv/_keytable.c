/* Ordered hash tables of chunk keys that never rehash all at once.
 *
 * Python's dict and OrderedDict grow by rehashing every entry in one step: at 700k
 * entries that holds the event loop for 26 and 46 ms on the development VM. These
 * tables grow their bucket array incrementally (a few old buckets move to the new array
 * on each insert or delete, as Redis does), keep their entries in fixed pages that never
 * move, and link them in insertion order, so that every operation costs O(1) with no
 * step proportional to the table.
 *
 * Keys are exact ``bytes``. ``KeyOrder`` maps each to ``bytes`` or ``None`` (a policy's
 * key -> predecessor); ``KeyInts`` maps each to a C integer (key -> slot, key -> count).
 * Neither holds an object that can hold another, so no reference cycle passes through
 * them and the types need no part in the cyclic garbage collector, which therefore never
 * walks their entries either.
 *
 * An entry takes 40 bytes and its bucket 4 to 8, against about 90 for an OrderedDict
 * entry and 75 for a dict entry with its int value.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define PAGE_BITS 12
#define PAGE_ENTRIES (1 << PAGE_BITS)
#define PAGE_MASK (PAGE_ENTRIES - 1)
/* The first page starts this small and doubles up to PAGE_ENTRIES (entries are named by
 * index, never by pointer across calls, so it may move): a policy of a small tenant costs
 * a few hundred bytes, not a whole page. */
#define FIRST_PAGE_ENTRIES 8
/* Old buckets moved to the new array per insert or delete while the table grows; with
 * growth at one entry per bucket, the move ends long before the new array fills. */
#define MOVE_STEP 16
#define FIRST_BUCKETS 8
#define MAX_ENTRIES 0x7ffffff0

/* Entry and bucket links are 1-based: 0 means none. */
typedef struct {
    PyObject *key; /* NULL: a free entry */
    union {
        PyObject *obj;
        long long num;
    } value;
    Py_hash_t hash;
    int32_t chain; /* the next entry of the bucket, or of the free list */
    int32_t link[2]; /* insertion order: the entry before (0) and after (1) */
} Entry;

typedef struct {
    int32_t *heads;
    size_t mask;
} Buckets;

typedef struct {
    PyObject_HEAD
    Entry **pages;
    Py_ssize_t npages;
    Py_ssize_t pages_cap;
    int32_t top;  /* entries ever handed out */
    int32_t room; /* entries the pages hold */
    int32_t free; /* free list */
    Py_ssize_t count;
    Buckets main;
    Buckets old; /* heads != NULL while the table grows */
    size_t moved; /* old buckets already moved */
    int32_t ends[2]; /* the oldest (0) and newest (1) entry */
    uint64_t version; /* changes whenever keys or their order change */
    int ints;
} Table;

static PyTypeObject KeyOrderType;
static PyTypeObject KeyIntsType;
static PyTypeObject IterType;

#define ENTRY(t, i) (&(t)->pages[((i) - 1) >> PAGE_BITS][((i) - 1) & PAGE_MASK])

static int
check_key(PyObject *key)
{
    if (!PyBytes_CheckExact(key)) {
        PyErr_Format(PyExc_TypeError, "keys must be bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    return 0;
}

static inline int
same_key(PyObject *a, PyObject *b)
{
    if (a == b)
        return 1;
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), n) == 0;
}

/* The link (a bucket head or an entry's chain) that holds ``key``'s entry, or NULL. */
static int32_t *
chain_find(Table *t, int32_t *link, PyObject *key, Py_hash_t hash)
{
    while (*link) {
        Entry *e = ENTRY(t, *link);
        if (e->hash == hash && same_key(e->key, key))
            return link;
        link = &e->chain;
    }
    return NULL;
}

static int32_t *
locate(Table *t, PyObject *key, Py_hash_t hash)
{
    if (t->old.heads != NULL) {
        size_t b = (size_t)hash & t->old.mask;
        if (b >= t->moved) {
            int32_t *link = chain_find(t, &t->old.heads[b], key, hash);
            if (link != NULL)
                return link;
        }
    }
    return chain_find(t, &t->main.heads[(size_t)hash & t->main.mask], key, hash);
}

/* The entry of ``key`` (0: absent; -1 with an exception: unhashable). */
static int32_t
find(Table *t, PyObject *key)
{
    if (!PyBytes_CheckExact(key))
        return 0;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1)
        return -1;
    int32_t *link = locate(t, key, hash);
    return link == NULL ? 0 : *link;
}

static void
move_buckets(Table *t, int steps)
{
    while (t->old.heads != NULL && steps-- > 0) {
        int32_t i = t->old.heads[t->moved];
        while (i) {
            Entry *e = ENTRY(t, i);
            int32_t next = e->chain;
            int32_t *head = &t->main.heads[(size_t)e->hash & t->main.mask];
            e->chain = *head;
            *head = i;
            i = next;
        }
        t->old.heads[t->moved] = 0;
        if (++t->moved > t->old.mask) {
            PyMem_Free(t->old.heads);
            t->old.heads = NULL;
            t->moved = 0;
        }
    }
}

static int
new_buckets(Buckets *b, size_t n)
{
    b->heads = PyMem_Calloc(n, sizeof(int32_t));
    if (b->heads == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->mask = n - 1;
    return 0;
}

/* Room for one more entry: a free one, a bucket array that may grow. */
static int
make_room(Table *t)
{
    if (t->count >= MAX_ENTRIES) {
        PyErr_SetString(PyExc_OverflowError, "key table is full");
        return -1;
    }
    if (t->old.heads == NULL && (size_t)t->count >= t->main.mask + 1) {
        Buckets bigger;
        if (new_buckets(&bigger, 2 * (t->main.mask + 1)) < 0)
            return -1;
        t->old = t->main;
        t->main = bigger;
        t->moved = 0;
    }
    if (t->free == 0 && t->top == t->room) {
        if (t->npages == 1 && t->room < PAGE_ENTRIES) {
            int32_t room = 2 * t->room;
            Entry *page = PyMem_Realloc(t->pages[0], room * sizeof(Entry));
            if (page == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->pages[0] = page;
            t->room = room;
            return 0;
        }
        if (t->npages == t->pages_cap) {
            Py_ssize_t cap = t->pages_cap ? 2 * t->pages_cap : 4;
            Entry **pages = PyMem_Realloc(t->pages, cap * sizeof(Entry *));
            if (pages == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->pages = pages;
            t->pages_cap = cap;
        }
        int32_t entries = t->npages == 0 ? FIRST_PAGE_ENTRIES : PAGE_ENTRIES;
        Entry *page = PyMem_Malloc(entries * sizeof(Entry));
        if (page == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->pages[t->npages++] = page;
        t->room = t->npages == 1 ? entries : t->room + entries;
    }
    return 0;
}

static void
unlink_order(Table *t, int32_t i, Entry *e)
{
    for (int side = 0; side < 2; side++) {
        if (e->link[side])
            ENTRY(t, e->link[side])->link[!side] = e->link[!side];
        else
            t->ends[side] = e->link[!side];
    }
}

/* Make entry ``i`` the newest (``last``) or the oldest. */
static void
link_end(Table *t, int32_t i, Entry *e, int last)
{
    e->link[last] = 0;
    e->link[!last] = t->ends[last];
    if (t->ends[last])
        ENTRY(t, t->ends[last])->link[last] = i;
    else
        t->ends[!last] = i;
    t->ends[last] = i;
}

/* Append absent ``key`` (its hash known) with ``value`` (a new reference, or a number).
 * make_room() must have succeeded. */
static int32_t
append(Table *t, PyObject *key, Py_hash_t hash, PyObject *obj, long long num)
{
    int32_t i;
    if (t->free) {
        i = t->free;
        t->free = ENTRY(t, i)->chain;
    }
    else {
        i = ++t->top;
    }
    Entry *e = ENTRY(t, i);
    Py_INCREF(key);
    e->key = key;
    if (t->ints)
        e->value.num = num;
    else
        e->value.obj = obj;
    e->hash = hash;
    int32_t *head = &t->main.heads[(size_t)hash & t->main.mask];
    e->chain = *head;
    *head = i;
    link_end(t, i, e, 1);
    t->count++;
    t->version++;
    move_buckets(t, MOVE_STEP);
    return i;
}

/* Take out the entry that ``link`` holds; returns its value's reference (or NULL for a
 * number, stored in *num). */
static PyObject *
take(Table *t, int32_t *link, long long *num)
{
    int32_t i = *link;
    Entry *e = ENTRY(t, i);
    PyObject *value = NULL;
    *link = e->chain;
    unlink_order(t, i, e);
    if (t->ints)
        *num = e->value.num;
    else
        value = e->value.obj;
    Py_DECREF(e->key);
    e->key = NULL;
    e->chain = t->free;
    t->free = i;
    t->count--;
    t->version++;
    move_buckets(t, MOVE_STEP);
    return value;
}

static int
read_value(Table *t, PyObject *value, PyObject **obj, long long *num)
{
    if (t->ints) {
        if (!PyLong_Check(value)) {
            PyErr_Format(PyExc_TypeError, "values must be integers, not %.100s", Py_TYPE(value)->tp_name);
            return -1;
        }
        *num = PyLong_AsLongLong(value);
        return (*num == -1 && PyErr_Occurred()) ? -1 : 0;
    }
    if (value != Py_None && !PyBytes_CheckExact(value)) {
        PyErr_Format(PyExc_TypeError, "values must be bytes or None, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    *obj = value;
    return 0;
}

static PyObject *
value_of(Table *t, Entry *e)
{
    if (t->ints)
        return PyLong_FromLongLong(e->value.num);
    return Py_NewRef(e->value.obj);
}

/* The value taken out by take(), as a new reference. */
static PyObject *
taken_value(Table *t, PyObject *obj, long long num)
{
    return t->ints ? PyLong_FromLongLong(num) : obj;
}

/* Set ``key`` to ``value``: replaced in place if present, appended otherwise. */
static int
set_item(Table *t, PyObject *key, PyObject *value)
{
    PyObject *obj = NULL;
    long long num = 0;
    if (check_key(key) < 0 || read_value(t, value, &obj, &num) < 0)
        return -1;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1)
        return -1;
    int32_t *link = locate(t, key, hash);
    if (link != NULL) {
        Entry *e = ENTRY(t, *link);
        if (t->ints) {
            e->value.num = num;
        }
        else {
            PyObject *before = e->value.obj;
            e->value.obj = Py_NewRef(obj);
            Py_DECREF(before);
        }
        return 0;
    }
    if (make_room(t) < 0)
        return -1;
    append(t, key, hash, obj == NULL ? NULL : Py_NewRef(obj), num);
    return 0;
}

static void
release_all(Table *t)
{
    for (int32_t i = t->ends[0]; i;) {
        Entry *e = ENTRY(t, i);
        i = e->link[1];
        Py_DECREF(e->key);
        if (!t->ints)
            Py_DECREF(e->value.obj);
    }
    for (Py_ssize_t p = 0; p < t->npages; p++)
        PyMem_Free(t->pages[p]);
    PyMem_Free(t->pages);
    PyMem_Free(t->main.heads);
    PyMem_Free(t->old.heads);
    t->pages = NULL;
    t->npages = t->pages_cap = 0;
    t->top = t->free = t->room = 0;
    t->count = 0;
    t->main.heads = t->old.heads = NULL;
    t->moved = 0;
    t->ends[0] = t->ends[1] = 0;
    t->version++;
}

/* -- the type ------------------------------------------------------------------------ */

static PyObject *
table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs)) || PyTuple_GET_SIZE(args)) {
        PyErr_Format(PyExc_TypeError, "%s() takes no arguments", type->tp_name);
        return NULL;
    }
    Table *t = (Table *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->ints = PyType_IsSubtype(type, &KeyIntsType);
    if (new_buckets(&t->main, FIRST_BUCKETS) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void
table_dealloc(Table *t)
{
    release_all(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
table_length(Table *t)
{
    return t->count;
}

static int
table_contains(Table *t, PyObject *key)
{
    int32_t i = find(t, key);
    return i < 0 ? -1 : i > 0;
}

static PyObject *
table_contains_method(Table *t, PyObject *key)
{
    int32_t i = find(t, key);
    if (i < 0)
        return NULL;
    return PyBool_FromLong(i > 0);
}

static PyObject *
table_subscript(Table *t, PyObject *key)
{
    int32_t i = find(t, key);
    if (i < 0)
        return NULL;
    if (i == 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return value_of(t, ENTRY(t, i));
}

static int
table_ass_subscript(Table *t, PyObject *key, PyObject *value)
{
    if (value != NULL)
        return set_item(t, key, value);
    if (PyBytes_CheckExact(key)) {
        Py_hash_t hash = PyObject_Hash(key);
        if (hash == -1)
            return -1;
        int32_t *link = locate(t, key, hash);
        if (link != NULL) {
            long long num;
            Py_XDECREF(take(t, link, &num));
            return 0;
        }
    }
    PyErr_SetObject(PyExc_KeyError, key);
    return -1;
}

static int
check_count(const char *name, Py_ssize_t nargs, Py_ssize_t least, Py_ssize_t most)
{
    if (nargs >= least && nargs <= most)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments, got %zd", name, least, most, nargs);
    return -1;
}

static PyObject *
table_get(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("get", nargs, 1, 2) < 0)
        return NULL;
    int32_t i = find(t, args[0]);
    if (i < 0)
        return NULL;
    if (i == 0)
        return Py_NewRef(nargs > 1 ? args[1] : Py_None);
    return value_of(t, ENTRY(t, i));
}

static PyObject *
table_pop(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("pop", nargs, 1, 2) < 0)
        return NULL;
    PyObject *key = args[0];
    if (PyBytes_CheckExact(key)) {
        Py_hash_t hash = PyObject_Hash(key);
        if (hash == -1)
            return NULL;
        int32_t *link = locate(t, key, hash);
        if (link != NULL) {
            long long num = 0;
            PyObject *obj = take(t, link, &num);
            return taken_value(t, obj, num);
        }
    }
    if (nargs > 1)
        return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, key);
    return NULL;
}

static int
parse_last(const char *name, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int first, int *last)
{
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    Py_ssize_t most = first + 1;
    if (nargs < first || nargs + nkw > most) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d positional argument%s and an optional 'last'", name, first,
                     first == 1 ? "" : "s");
        return -1;
    }
    PyObject *flag = nargs > first ? args[first] : NULL;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(kwnames, k))
            || PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, k), "last") != 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", name,
                         PyTuple_GET_ITEM(kwnames, k));
            return -1;
        }
        flag = args[nargs + k];
    }
    *last = 1;
    if (flag != NULL) {
        *last = PyObject_IsTrue(flag);
        if (*last < 0)
            return -1;
    }
    return 0;
}

static PyObject *
table_move_to_end(Table *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    int last;
    if (parse_last("move_to_end", args, nargs, kwnames, 1, &last) < 0)
        return NULL;
    int32_t i = find(t, args[0]);
    if (i < 0)
        return NULL;
    if (i == 0) {
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    if (i != t->ends[last]) {
        Entry *e = ENTRY(t, i);
        unlink_order(t, i, e);
        link_end(t, i, e, last);
        t->version++;
    }
    Py_RETURN_NONE;
}

static PyObject *
table_popitem(Table *t, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    int last;
    if (parse_last("popitem", args, nargs, kwnames, 0, &last) < 0)
        return NULL;
    int32_t i = t->ends[last];
    if (i == 0) {
        PyErr_SetString(PyExc_KeyError, "popitem(): table is empty");
        return NULL;
    }
    Entry *e = ENTRY(t, i);
    Py_hash_t hash = e->hash;
    PyObject *key = Py_NewRef(e->key);
    PyObject *value = value_of(t, e);
    /* The pair first, so that running out of memory loses nothing. Allocating it may run
     * a collection, and finalizers that change the table: the key is found again. */
    PyObject *pair = value == NULL ? NULL : PyTuple_Pack(2, key, value);
    Py_XDECREF(value);
    if (pair != NULL) {
        int32_t *link = locate(t, key, hash);
        if (link != NULL) {
            long long num;
            Py_XDECREF(take(t, link, &num));
        }
    }
    Py_DECREF(key);
    return pair;
}

static PyObject *
table_clear(Table *t, PyObject *unused)
{
    Buckets fresh; /* first: out of memory leaves the table as it was */
    if (new_buckets(&fresh, FIRST_BUCKETS) < 0)
        return NULL;
    release_all(t);
    t->main = fresh;
    Py_RETURN_NONE;
}

/* Append every one of ``keys``, all absent and none twice, with ``value``; on a key
 * present or listed twice, KeyError(key) and the table as it was. */
static PyObject *
table_insert_new(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("insert_new", nargs, 2, 2) < 0)
        return NULL;
    PyObject *obj = NULL;
    long long num = 0;
    if (read_value(t, args[1], &obj, &num) < 0)
        return NULL;
    if (PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "insert_new() takes a sequence of keys, not one key");
        return NULL;
    }
    PyObject *keys = PySequence_Fast(args[0], "insert_new() takes a sequence of keys");
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    Py_ssize_t done = 0;
    for (; done < n; done++) {
        PyObject *key = items[done];
        if (check_key(key) < 0)
            goto undo;
        Py_hash_t hash = PyObject_Hash(key);
        if (hash == -1)
            goto undo;
        if (locate(t, key, hash) != NULL) {
            PyErr_SetObject(PyExc_KeyError, key);
            goto undo;
        }
        if (make_room(t) < 0)
            goto undo;
        append(t, key, hash, obj == NULL ? NULL : Py_NewRef(obj), num);
    }
    Py_DECREF(keys);
    Py_RETURN_NONE;
undo:
    /* The keys appended are the newest entries, in order. */
    while (done-- > 0) {
        Entry *e = ENTRY(t, t->ends[1]);
        long long ignored;
        Py_XDECREF(take(t, locate(t, e->key, e->hash), &ignored));
    }
    Py_DECREF(keys);
    return NULL;
}

/* Set each (key, value) pair of an iterable, as dict.update does. */
static PyObject *
table_update(Table *t, PyObject *pairs)
{
    PyObject *it = PyObject_GetIter(pairs);
    if (it == NULL)
        return NULL;
    PyObject *pair;
    while ((pair = PyIter_Next(it)) != NULL) {
        int rc;
        if (PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2) {
            rc = set_item(t, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
        }
        else {
            PyErr_SetString(PyExc_TypeError, "update() takes (key, value) tuples");
            rc = -1;
        }
        Py_DECREF(pair);
        if (rc < 0) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
table_sizeof(Table *t, PyObject *unused)
{
    size_t n = Py_TYPE(t)->tp_basicsize + t->pages_cap * sizeof(Entry *) + (size_t)t->room * sizeof(Entry)
               + (t->main.mask + 1) * sizeof(int32_t);
    if (t->old.heads != NULL)
        n += (t->old.mask + 1) * sizeof(int32_t);
    return PyLong_FromSize_t(n);
}

/* Equal to a dict, or a table of the same type, with the same items (in any order). */
static PyObject *
table_richcompare(Table *t, PyObject *other, int op)
{
    if ((op != Py_EQ && op != Py_NE) || (!PyDict_Check(other) && Py_TYPE(other) != Py_TYPE(t)))
        Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t n = PyDict_Check(other) ? PyDict_GET_SIZE(other) : ((Table *)other)->count;
    int equal = n == t->count;
    uint64_t version = t->version;
    for (int32_t i = t->ends[0]; equal && i;) {
        Entry *e = ENTRY(t, i);
        i = e->link[1];
        PyObject *mine = value_of(t, e);
        if (mine == NULL)
            return NULL;
        PyObject *key = Py_NewRef(e->key); /* the other side's code may drop ours */
        PyObject *theirs = PyDict_Check(other) ? Py_XNewRef(PyDict_GetItemWithError(other, key))
                                               : PyObject_GetItem(other, key);
        Py_DECREF(key);
        if (t->version != version) { /* the lookup ran the other side's code, which changed us */
            Py_XDECREF(theirs);
            Py_DECREF(mine);
            PyErr_Format(PyExc_RuntimeError, "%s changed during comparison", Py_TYPE(t)->tp_name);
            return NULL;
        }
        if (theirs == NULL) {
            Py_DECREF(mine);
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_KeyError))
                return NULL;
            PyErr_Clear();
            equal = 0;
            break;
        }
        equal = PyObject_RichCompareBool(mine, theirs, Py_EQ);
        Py_DECREF(mine);
        Py_DECREF(theirs);
        if (equal < 0)
            return NULL;
        if (t->version != version) { /* the other side's code changed this table */
            PyErr_Format(PyExc_RuntimeError, "%s changed during comparison", Py_TYPE(t)->tp_name);
            return NULL;
        }
    }
    return PyBool_FromLong(op == Py_EQ ? equal : !equal);
}

static PyObject *
table_repr(Table *t)
{
    return PyUnicode_FromFormat("<%s of %zd keys>", Py_TYPE(t)->tp_name, t->count);
}

/* -- iteration (insertion order, or from the newest) ---------------------------------- */

enum { KEYS, VALUES, ITEMS };

typedef struct {
    PyObject_HEAD
    Table *table;
    int32_t at;
    uint64_t version;
    int kind;
    int reverse;
} Iter;

static PyObject *
iter_new(Table *t, int kind, int reverse)
{
    Iter *it = PyObject_New(Iter, &IterType);
    if (it == NULL)
        return NULL;
    it->table = (Table *)Py_NewRef(t);
    it->at = t->ends[reverse];
    it->version = t->version;
    it->kind = kind;
    it->reverse = reverse;
    return (PyObject *)it;
}

static void
iter_dealloc(Iter *it)
{
    Py_XDECREF(it->table);
    PyObject_Free(it);
}

static PyObject *
iter_next(Iter *it)
{
    Table *t = it->table;
    if (t == NULL || it->at == 0)
        return NULL;
    if (t->version != it->version) {
        PyErr_Format(PyExc_RuntimeError, "%s changed during iteration", Py_TYPE(t)->tp_name);
        it->at = 0;
        return NULL;
    }
    Entry *e = ENTRY(t, it->at);
    it->at = e->link[!it->reverse];
    if (it->kind == KEYS)
        return Py_NewRef(e->key);
    PyObject *value = value_of(t, e);
    if (it->kind == VALUES || value == NULL)
        return value;
    PyObject *key = Py_NewRef(e->key); /* owned: allocating the pair may run finalizers */
    PyObject *pair = PyTuple_Pack(2, key, value);
    Py_DECREF(key);
    Py_DECREF(value);
    return pair;
}

static PyObject *
table_iter(Table *t)
{
    return iter_new(t, KEYS, 0);
}

#define ITERATOR_METHOD(NAME, KIND, REVERSE)                                                                          \
    static PyObject *NAME(Table *t, PyObject *unused) { return iter_new(t, KIND, REVERSE); }

ITERATOR_METHOD(table_reversed, KEYS, 1)
ITERATOR_METHOD(table_keys, KEYS, 0)
ITERATOR_METHOD(table_values, VALUES, 0)
ITERATOR_METHOD(table_items, ITEMS, 0)

static PyTypeObject IterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tiered_kv._keytable.Iterator",
    .tp_basicsize = sizeof(Iter),
    .tp_dealloc = (destructor)iter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)iter_next,
};

static PyMethodDef table_methods[] = {
    {"__contains__", (PyCFunction)table_contains_method, METH_O | METH_COEXIST, NULL},
    {"__getitem__", (PyCFunction)table_subscript, METH_O | METH_COEXIST, NULL},
    {"__reversed__", (PyCFunction)table_reversed, METH_NOARGS, NULL},
    {"__sizeof__", (PyCFunction)table_sizeof, METH_NOARGS, NULL},
    {"get", (PyCFunction)(void (*)(void))table_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))table_pop, METH_FASTCALL, "pop(key[, default])"},
    {"popitem", (PyCFunction)(void (*)(void))table_popitem, METH_FASTCALL | METH_KEYWORDS,
     "popitem(last=True): the newest (or oldest) (key, value), taken out"},
    {"move_to_end", (PyCFunction)(void (*)(void))table_move_to_end, METH_FASTCALL | METH_KEYWORDS,
     "move_to_end(key, last=True): make key the newest (or the oldest)"},
    {"insert_new", (PyCFunction)(void (*)(void))table_insert_new, METH_FASTCALL,
     "insert_new(keys, value): append absent keys, all or none"},
    {"update", (PyCFunction)table_update, METH_O, "update(pairs): set each (key, value)"},
    {"clear", (PyCFunction)table_clear, METH_NOARGS, NULL},
    {"keys", (PyCFunction)table_keys, METH_NOARGS, "an iterator over the keys, oldest first"},
    {"values", (PyCFunction)table_values, METH_NOARGS, "an iterator over the values, oldest first"},
    {"items", (PyCFunction)table_items, METH_NOARGS, "an iterator over (key, value), oldest first"},
    {NULL, NULL},
};

static PyMappingMethods table_as_mapping = {
    .mp_length = (lenfunc)table_length,
    .mp_subscript = (binaryfunc)table_subscript,
    .mp_ass_subscript = (objobjargproc)table_ass_subscript,
};

static PySequenceMethods table_as_sequence = {
    .sq_contains = (objobjproc)table_contains,
};

#define TABLE_TYPE(NAME, DOC)                                                                                         \
    {                                                                                                                 \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tiered_kv._keytable." NAME, .tp_basicsize = sizeof(Table),          \
        .tp_dealloc = (destructor)table_dealloc, .tp_repr = (reprfunc)table_repr,                                     \
        .tp_as_sequence = &table_as_sequence, .tp_as_mapping = &table_as_mapping,                                     \
        .tp_hash = PyObject_HashNotImplemented, .tp_richcompare = (richcmpfunc)table_richcompare, .tp_flags = Py_TPFLAGS_DEFAULT, .tp_doc = DOC,                        \
        .tp_iter = (getiterfunc)table_iter, .tp_methods = table_methods, .tp_new = table_new,                         \
    }

static PyTypeObject KeyOrderType = TABLE_TYPE(
    "KeyOrder", "KeyOrder(): bytes keys -> bytes or None, in insertion order, growing without a full rehash.");
static PyTypeObject KeyIntsType = TABLE_TYPE(
    "KeyInts", "KeyInts(): bytes keys -> integers (64-bit), in insertion order, growing without a full rehash.");

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tiered_kv._keytable",
    .m_doc = "Ordered tables of chunk keys that grow in O(1) steps.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__keytable(void)
{
    if (PyType_Ready(&IterType) < 0 || PyType_Ready(&KeyOrderType) < 0 || PyType_Ready(&KeyIntsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "KeyOrder", (PyObject *)&KeyOrderType) < 0
        || PyModule_AddObjectRef(m, "KeyInts", (PyObject *)&KeyIntsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
