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
 *
 * ``PrefixLists`` runs the per-key steps of a store in LRU and ARC (policies/) over their
 * tables: the eviction walk that takes leaves of the prefix tree first, and ARC's insert.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
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
    /* The pages of entries a clear_in_steps() took out, whose references are dropped a
     * step at a time: entries dying_next down to 1 are left. */
    Entry **dying;
    Py_ssize_t ndying, dying_cap; /* pages, and room for page pointers */
    int32_t dying_room; /* entries they hold room for */
    int32_t dying_next;
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

/* Buckets above this many bytes are written once as they are made, without the GIL. */
#define TOUCH_BUCKET_BYTES (1 << 20)

/* new_buckets(), every page of them written once, without the GIL where they are large:
 * a large array comes zeroed from the kernel a page at a time as it is first touched,
 * and the first batch of a warm restart into a million-entry table, touching most of
 * its pages, took 3 ms of faults. Called from a thread other than the event loop's,
 * the loop runs meanwhile. */
static int
touched_buckets(Buckets *b, size_t n)
{
    size_t nbytes = n * sizeof(int32_t);
    if (nbytes <= TOUCH_BUCKET_BYTES)
        return new_buckets(b, n);
    int32_t *heads = PyMem_Malloc(nbytes); /* with the GIL; only the writing goes without */
    if (heads == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    memset(heads, 0, nbytes);
    Py_END_ALLOW_THREADS
    b->heads = heads;
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

/* A batch's probes, each in a random bucket of a table of up to millions of entries,
 * would each wait on memory twice: for the bucket's head, then for the first entry of
 * its chain. ``probe_ahead(t, items, i, n)`` before probing ``items[i]`` brings in the
 * head of the key PROBE_AHEAD places on, and the first entry of the one half as far
 * (whose head came in earlier), so that the waits overlap. Only a hint: a key that is
 * not exact bytes is skipped (its probe raises); the hashes are cached in the keys. */
#define PROBE_AHEAD 16

static inline void
prefetch_head(Table *t, PyObject *key)
{
    if (PyBytes_CheckExact(key))
        __builtin_prefetch(&t->main.heads[(size_t)PyObject_Hash(key) & t->main.mask]);
}

static inline void
prefetch_chain(Table *t, PyObject *key)
{
    if (!PyBytes_CheckExact(key))
        return;
    int32_t head = t->main.heads[(size_t)PyObject_Hash(key) & t->main.mask];
    if (head)
        __builtin_prefetch(ENTRY(t, head));
}

static inline void
probe_ahead(Table *t, PyObject *const *items, Py_ssize_t i, Py_ssize_t n)
{
    if (i + PROBE_AHEAD < n)
        prefetch_head(t, items[i + PROBE_AHEAD]);
    if (i + PROBE_AHEAD / 2 < n)
        prefetch_chain(t, items[i + PROBE_AHEAD / 2]);
}

/* Before the first probe of a batch: the heads of the keys the first probe_ahead()
 * calls would have brought in had they run. */
static inline void
probe_start(Table *t, PyObject *const *items, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < PROBE_AHEAD / 2 && i < n; i++)
        prefetch_head(t, items[i]);
}

/* ``arg`` as a fast sequence of keys for method ``name`` (a new reference), or NULL with
 * TypeError: one bytes key is refused, for it is a sequence too (of ints). */
static PyObject *
key_sequence(PyObject *arg, const char *name)
{
    if (PyBytes_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s() takes a sequence of keys, not one key", name);
        return NULL;
    }
    char message[64];
    PyOS_snprintf(message, sizeof message, "%s() takes a sequence of keys", name);
    return PySequence_Fast(arg, message);
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

/* The table holds no entry, no page and no bucket array (its pages were freed or
 * taken elsewhere; a caller that goes on using it gives it buckets). */
static void
forget_entries(Table *t)
{
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

/* Drop the references of up to ``n`` entries a clear_in_steps() took out (all: n < 0),
 * from the last down, freeing each page once the walk has passed it. Pages come from the
 * C heap in the order they were made: the last is the likeliest at its top, and freed
 * from the top the heap gives memory back to the system a little at a time. Freed from
 * the bottom, the whole of it went back when the last page did: about 3 ms of one step
 * at a million entries. */
static void
drop_dying(Table *t, Py_ssize_t n)
{
    for (; t->dying != NULL && t->dying_next > 0; t->dying_next--) {
        int32_t i = t->dying_next - 1;
        Entry *e = &t->dying[i >> PAGE_BITS][i & PAGE_MASK];
        if (e->key != NULL) { /* else on the free list */
            if (n-- == 0)
                break; /* at a live entry: none is left only once the walk has ended */
            PyObject *key = e->key, *obj = t->ints ? NULL : e->value.obj;
            e->key = NULL;
            Py_DECREF(key); /* bytes, and bytes or None: no code runs */
            Py_XDECREF(obj);
        }
        if ((i & PAGE_MASK) == 0) { /* the first entry of a page: all of it passed */
            PyMem_Free(t->dying[i >> PAGE_BITS]);
            t->dying[i >> PAGE_BITS] = NULL;
            t->dying_room = (i >> PAGE_BITS) * PAGE_ENTRIES; /* the pages below */
        }
    }
    if (t->dying != NULL && t->dying_next == 0) {
        /* Every page went as the walk passed its first entry: a page is only ever made
         * for the entry appended next, so none lies above the last. */
        PyMem_Free(t->dying);
        t->dying = NULL;
        t->ndying = t->dying_cap = 0;
        t->dying_room = t->dying_next = 0;
    }
}

static void
release_all(Table *t)
{
    drop_dying(t, -1);
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
    forget_entries(t);
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

/* Take out the ``done`` newest entries (those an insert appended before it failed). */
static void
undo_appended(Table *t, Py_ssize_t done)
{
    while (done-- > 0) {
        Entry *e = ENTRY(t, t->ends[1]);
        long long ignored;
        Py_XDECREF(take(t, locate(t, e->key, e->hash), &ignored));
    }
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
    PyObject *keys = key_sequence(args[0], "insert_new");
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    Py_ssize_t done = 0;
    probe_start(t, items, n);
    for (; done < n; done++) {
        probe_ahead(t, items, done, n);
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
    undo_appended(t, done); /* the keys appended are the newest entries, in order */
    Py_DECREF(keys);
    return NULL;
}

/* clear() in steps: a call takes every entry out at once (the table is empty and
 * usable from then on), unless an earlier call's are still being let go of, and drops
 * the references of at most ``n`` of those taken out; true while some are left or the
 * table holds entries (inserted meanwhile: a later call takes them out). */
static PyObject *
table_clear_in_steps(Table *t, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n <= 0) {
        PyErr_SetString(PyExc_ValueError, "clear_in_steps() takes a positive number of entries");
        return NULL;
    }
    if (t->dying == NULL && t->count) {
        Buckets fresh; /* first: out of memory leaves the table as it was */
        if (new_buckets(&fresh, FIRST_BUCKETS) < 0)
            return NULL;
        t->dying = t->pages;
        t->ndying = t->npages;
        t->dying_cap = t->pages_cap;
        t->dying_room = t->room;
        t->dying_next = t->top;
        forget_entries(t);
        t->main = fresh;
    }
    drop_dying(t, n);
    return PyBool_FromLong(t->dying != NULL || t->count);
}

/* An empty table about to be filled: its bucket array sized for ``n`` entries at once,
 * so that it does not grow (and move its buckets) while it fills. */
static PyObject *
table_reserve(Table *t, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n > MAX_ENTRIES) {
        PyErr_Format(PyExc_ValueError, "a key table holds at most %d entries, not %zd", MAX_ENTRIES, n);
        return NULL;
    }
    if (t->count || t->old.heads != NULL || n <= (Py_ssize_t)(t->main.mask + 1))
        Py_RETURN_NONE;
    size_t buckets = t->main.mask + 1;
    while ((Py_ssize_t)buckets < n)
        buckets *= 2;
    Buckets sized;
    if (touched_buckets(&sized, buckets) < 0)
        return NULL;
    /* Another thread may have used the table while the GIL was let go of: sized only if
     * it is still empty and smaller. */
    if (t->count || t->old.heads != NULL || buckets <= t->main.mask + 1) {
        PyMem_Free(sized.heads);
        Py_RETURN_NONE;
    }
    PyMem_Free(t->main.heads);
    t->main = sized;
    Py_RETURN_NONE;
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

/* Whether any of ``keys`` is in the table (others than exact bytes never are), with the
 * probes of the batch overlapped; stops at the first found. */
static PyObject *
table_contains_any(Table *t, PyObject *arg)
{
    PyObject *keys = key_sequence(arg, "contains_any");
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    int32_t found = 0;
    probe_start(t, items, n);
    for (Py_ssize_t i = 0; found == 0 && i < n; i++) {
        probe_ahead(t, items, i, n);
        found = find(t, items[i]);
    }
    Py_DECREF(keys);
    if (found < 0)
        return NULL;
    return PyBool_FromLong(found > 0);
}

/* Set each ``keys[i]`` to ``values[i]``, as update(zip(keys, values)) does (the pairs
 * before a bad one stay set), with the probes of the batch overlapped. */
static PyObject *
table_set_many(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("set_many", nargs, 2, 2) < 0)
        return NULL;
    PyObject *keys = key_sequence(args[0], "set_many");
    if (keys == NULL)
        return NULL;
    PyObject *values = PySequence_Fast(args[1], "set_many() takes a sequence of values");
    if (values == NULL) {
        Py_DECREF(keys);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    int rc = 0;
    if (PySequence_Fast_GET_SIZE(values) != n) {
        PyErr_Format(PyExc_ValueError, "set_many() takes a value per key: %zd values for %zd keys",
                     PySequence_Fast_GET_SIZE(values), n);
        rc = -1;
    }
    /* Neither a key's hash nor a value's conversion runs Python code (exact bytes; bytes,
     * None or int, whose subclasses convert in C), so neither list changes meanwhile. */
    PyObject **items = PySequence_Fast_ITEMS(keys), **given = PySequence_Fast_ITEMS(values);
    if (rc == 0)
        probe_start(t, items, n);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        probe_ahead(t, items, i, n);
        rc = set_item(t, items[i], given[i]);
    }
    Py_DECREF(keys);
    Py_DECREF(values);
    if (rc < 0)
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
    n += t->dying_cap * sizeof(Entry *) + (size_t)t->dying_room * sizeof(Entry);
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
    {"contains_any", (PyCFunction)table_contains_any, METH_O,
     "contains_any(keys): whether any of keys is in the table"},
    {"set_many", (PyCFunction)(void (*)(void))table_set_many, METH_FASTCALL,
     "set_many(keys, values): set each key to its value, as update(zip(keys, values))"},
    {"reserve", (PyCFunction)table_reserve, METH_O, "reserve(n): an empty table sized for n entries at once"},
    {"clear", (PyCFunction)table_clear, METH_NOARGS, NULL},
    {"clear_in_steps", (PyCFunction)table_clear_in_steps, METH_O,
     "clear_in_steps(n): clear() letting go of at most n entries per call; true while some are left"},
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

/* -- a policy's lists with prefix links: the eviction walk and ARC's insert --------- */

/* The hot steps of a prefix-aware policy (see policies/prefix.py) over its own tables: one
 * or two ordered lists of resident keys (key -> predecessor), their parked keys (a dict
 * key -> (place, predecessor) and a list of counts per place), the count of resident
 * successors of each key (a KeyInts), and for ARC its ghost lists and recency target.
 * The Python policy keeps the same objects for its colder steps; this type holds
 * references to them, none to the policy, so no cycle passes through it. */
typedef struct {
    PyObject_HEAD
    int nlists;
    Table *lists[2];
    long places[2]; /* the policy's number of each list (what parked entries record) */
    Table *ghosts[2]; /* NULL: no ghost lists */
    Py_ssize_t ghost_limit;
    Table *successors;
    PyObject *parked; /* dict */
    PyObject *parked_at; /* list of int, indexed by place */
    PyObject *error; /* the exception type of a broken contract (a duplicate key) */
    Py_ssize_t capacity;
    double target;
} Lists;

static PyTypeObject ListsType;

/* An entry of ``t`` for ``key`` (hash known), or 0. */
static int32_t
entry_of(Table *t, PyObject *key, Py_hash_t hash)
{
    int32_t *link = locate(t, key, hash);
    return link == NULL ? 0 : *link;
}

/* Append absent ``key`` with ``value`` (a borrowed object, or NULL and a number). */
static int
append_new(Table *t, PyObject *key, Py_hash_t hash, PyObject *obj, long long num)
{
    if (make_room(t) < 0)
        return -1;
    append(t, key, hash, obj == NULL ? NULL : Py_NewRef(obj), num);
    return 0;
}

/* Take ``key`` out of ``t`` if there; 1 with its value (a new reference) in *obj, else 0. */
static int
pop_entry(Table *t, PyObject *key, Py_hash_t hash, PyObject **obj, long long *num)
{
    int32_t *link = locate(t, key, hash);
    if (link == NULL)
        return 0;
    *obj = take(t, link, num);
    return 1;
}

static void
pop_oldest(Table *t)
{
    Entry *e = ENTRY(t, t->ends[0]);
    long long ignored;
    Py_XDECREF(take(t, locate(t, e->key, e->hash), &ignored));
}

/* The count of keys parked from ``place`` (-1 with an error: not a place counted). */
static Py_ssize_t
parked_count(Lists *l, long place)
{
    if (place < 0 || place >= PyList_GET_SIZE(l->parked_at)) {
        PyErr_Format(PyExc_IndexError, "parked_at counts no place %ld", place);
        return -1;
    }
    return PyLong_AsSsize_t(PyList_GET_ITEM(l->parked_at, place));
}

static int
add_parked_count(Lists *l, long place, Py_ssize_t delta)
{
    Py_ssize_t now = parked_count(l, place);
    if (now == -1 && PyErr_Occurred())
        return -1;
    PyObject *value = PyLong_FromSsize_t(now + delta);
    if (value == NULL)
        return -1;
    PyList_SetItem(l->parked_at, place, value); /* steals ``value`` */
    return 0;
}

/* The parked entry of ``key``, (place, predecessor) (borrowed); NULL, with an error only
 * if there is one, when ``key`` is not parked. */
static PyObject *
parked_entry(Lists *l, PyObject *key)
{
    PyObject *parked = PyDict_GetItemWithError(l->parked, key);
    if (parked != NULL && (!PyTuple_CheckExact(parked) || PyTuple_GET_SIZE(parked) != 2)) {
        PyErr_SetString(PyExc_TypeError, "a parked entry must be a (place, predecessor) tuple");
        return NULL;
    }
    return parked;
}

/* The list of place ``place`` (a place not the first is the second, as the policies
 * number them). */
static int
list_index(Lists *l, long place)
{
    return place == l->places[0] ? 0 : l->nlists - 1;
}

static PyObject *
contract_error(Lists *l, const char *format, PyObject *key)
{
    PyObject *hex = PyObject_CallMethod(key, "hex", NULL);
    if (hex != NULL) {
        PyErr_Format(l->error, format, hex);
        Py_DECREF(hex);
    }
    return NULL;
}

/* Take ``key`` out of the parked keys: 1 with the list it was parked from and its
 * predecessor (a new reference), 0 if it is not parked (an error when ``resident``: it
 * was in none of the lists either), -1 on an error. */
static int
unpark(Lists *l, PyObject *key, int resident, long *place, PyObject **parent)
{
    PyObject *parked = parked_entry(l, key);
    if (parked == NULL) {
        if (PyErr_Occurred())
            return -1;
        if (resident) {
            contract_error(l, "key %U is not resident", key);
            return -1;
        }
        return 0;
    }
    Py_INCREF(parked);
    *place = PyLong_AsLong(PyTuple_GET_ITEM(parked, 0));
    *parent = Py_NewRef(PyTuple_GET_ITEM(parked, 1));
    Py_DECREF(parked);
    if ((*place == -1 && PyErr_Occurred()) || PyDict_DelItem(l->parked, key) < 0
        || add_parked_count(l, *place, -1) < 0) {
        Py_CLEAR(*parent);
        return -1;
    }
    return 1;
}

/* ``key`` is no longer resident: one successor fewer for ``parent``; a parked ``parent``
 * left without successors returns to the old end of its list. */
static int
unlink_parent(Lists *l, PyObject *parent)
{
    if (parent == Py_None)
        return 0;
    Py_hash_t hash = PyObject_Hash(parent);
    if (hash == -1)
        return -1;
    int32_t i = entry_of(l->successors, parent, hash);
    if (i == 0) {
        PyErr_SetObject(PyExc_KeyError, parent);
        return -1;
    }
    Entry *e = ENTRY(l->successors, i);
    if (--e->value.num != 0)
        return 0;
    PyObject *unused;
    long long ignored;
    pop_entry(l->successors, parent, hash, &unused, &ignored);
    long place;
    PyObject *grandparent;
    int parked = unpark(l, parent, 0, &place, &grandparent);
    if (parked <= 0)
        return parked;
    Table *list = l->lists[list_index(l, place)];
    int rc = set_item(list, parent, grandparent);
    Py_DECREF(grandparent);
    if (rc < 0)
        return -1;
    int32_t at = entry_of(list, parent, hash);
    if (at != list->ends[0]) {
        Entry *moved = ENTRY(list, at);
        unlink_order(list, at, moved);
        link_end(list, at, moved, 0);
        list->version++;
    }
    return 0;
}

/* -- inserts ------------------------------------------------------------------------- */

/* An insert's checks and prefix link: ``key`` (its hash known) resident nowhere, ``parent``
 * (or None) not the key itself, counted as continued once more. 0, or -1 with an error
 * (the policy's contract broken) and nothing changed. */
static int
link_new(Lists *l, PyObject *key, Py_hash_t hash, PyObject *parent)
{
    int resident = PyDict_Contains(l->parked, key);
    if (resident < 0)
        return -1;
    for (int i = 0; !resident && i < l->nlists; i++)
        resident = entry_of(l->lists[i], key, hash) != 0;
    if (resident) {
        contract_error(l, "key %U is already resident", key);
        return -1;
    }
    if (parent == Py_None)
        return 0;
    if (same_key(parent, key)) {
        contract_error(l, "key %U cannot be its own predecessor", key);
        return -1;
    }
    Py_hash_t parent_hash = PyObject_Hash(parent);
    if (parent_hash == -1)
        return -1;
    int32_t i = entry_of(l->successors, parent, parent_hash);
    if (i)
        ENTRY(l->successors, i)->value.num++;
    else if (append_new(l->successors, parent, parent_hash, NULL, 1) < 0)
        return -1;
    return 0;
}

/* LRU's insert of a new key continuing ``parent``: the newest of its one list. */
static PyObject *
lists_lru_insert(Lists *l, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("lru_insert", nargs, 1, 2) < 0)
        return NULL;
    PyObject *key = args[0], *parent = nargs > 1 ? args[1] : Py_None;
    if (l->nlists != 1) {
        PyErr_SetString(PyExc_TypeError, "lru_insert() needs one list");
        return NULL;
    }
    if (check_key(key) < 0 || (parent != Py_None && check_key(parent) < 0))
        return NULL;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1 || link_new(l, key, hash, parent) < 0)
        return NULL;
    if (append_new(l->lists[0], key, hash, parent, 0) < 0)
        return NULL; /* the successor count is off by one: as in arc_insert */
    Py_RETURN_NONE;
}

/* -- ARC's insert -------------------------------------------------------------------- */

/* ARC's insert of a new key continuing ``parent`` (see policies/arc.py). */
static PyObject *
lists_arc_insert(Lists *l, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("arc_insert", nargs, 1, 2) < 0)
        return NULL;
    PyObject *key = args[0], *parent = nargs > 1 ? args[1] : Py_None;
    if (l->nlists != 2 || l->ghosts[0] == NULL) {
        PyErr_SetString(PyExc_TypeError, "arc_insert() needs two lists and their ghosts");
        return NULL;
    }
    if (check_key(key) < 0 || (parent != Py_None && check_key(parent) < 0))
        return NULL;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1)
        return NULL;
    Table *t1 = l->lists[0], *t2 = l->lists[1], *b1 = l->ghosts[0], *b2 = l->ghosts[1];
    if (link_new(l, key, hash, parent) < 0)
        return NULL;
    PyObject *ghost;
    long long ignored;
    Table *into = t2;
    if (pop_entry(b1, key, hash, &ghost, &ignored)) {
        Py_XDECREF(ghost);
        double step = (double)b2->count / (double)(b1->count + 1);
        l->target = fmin((double)l->capacity, l->target + fmax(1.0, step));
    }
    else if (pop_entry(b2, key, hash, &ghost, &ignored)) {
        Py_XDECREF(ghost);
        double step = (double)b1->count / (double)(b2->count + 1);
        l->target = fmax(0.0, l->target - fmax(1.0, step));
    }
    else {
        into = t1;
    }
    if (append_new(into, key, hash, parent, 0) < 0)
        return NULL; /* the successor count is off by one: as in the policy's own insert */
    if (into == t1 && (b1->count || b2->count)) {
        /* Case IV: keep |T1| + |B1| <= c, else the whole directory <= 2c. */
        Py_ssize_t at1 = parked_count(l, l->places[0]), at2 = parked_count(l, l->places[1]);
        if ((at1 == -1 || at2 == -1) && PyErr_Occurred())
            return NULL;
        Py_ssize_t over = t1->count + at1 + b1->count - l->capacity;
        if (over > 0) {
            for (Py_ssize_t n = Py_MIN(over, b1->count); n > 0; n--)
                pop_oldest(b1);
        }
        else {
            Py_ssize_t over_all = over + t2->count + at2 + b2->count - l->capacity;
            for (Py_ssize_t n = Py_MIN(over_all, b2->count); n > 0; n--)
                pop_oldest(b2);
        }
    }
    Py_RETURN_NONE;
}

/* -- a hit ---------------------------------------------------------------------------- */

/* touch(key): a hit on resident ``key`` makes it the newest of the last list (LRU's one
 * list, ARC's T2), taken from the first list or from the parked keys if there. */
static PyObject *
lists_touch(Lists *l, PyObject *key)
{
    if (check_key(key) < 0)
        return NULL;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1)
        return NULL;
    Table *last = l->lists[l->nlists - 1];
    int32_t at = entry_of(last, key, hash);
    if (at) {
        if (at != last->ends[1]) {
            Entry *e = ENTRY(last, at);
            unlink_order(last, at, e);
            link_end(last, at, e, 1);
            last->version++;
        }
        Py_RETURN_NONE;
    }
    PyObject *parent;
    long long ignored;
    long place;
    if ((l->nlists == 1 || !pop_entry(l->lists[0], key, hash, &parent, &ignored))
        && unpark(l, key, 1, &place, &parent) < 0)
        return NULL;
    int rc = append_new(last, key, hash, parent, 0);
    Py_DECREF(parent);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* -- the eviction walk ---------------------------------------------------------------- */

typedef struct Protection Protection;
static PyTypeObject ProtectionType;
static int protection_check(Protection *p, PyObject *key);

typedef struct {
    long long rank;
    PyObject *key; /* owned */
} Ready;

/* One list walked from its old end (policies/prefix.py's LeafWalk). */
typedef struct {
    int32_t at; /* the next entry of the list; 0: the list is walked */
    long long seen;
    long long parked_rank; /* parked keys rank before every key of the list */
    Table *passed; /* key -> rank: passed over for their successors, in the order met */
    Ready *ready; /* a min-heap on rank */
    Py_ssize_t nready, ready_cap;
} Walk;

typedef struct {
    Lists *lists;
    PyObject *protected;
    Table *taken; /* key -> successors of it among the victims */
    PyObject *victims; /* list */
    uint64_t versions[2];
    Walk walks[2];
} Eviction;

static Table *
new_ints(void)
{
    return (Table *)PyObject_CallNoArgs((PyObject *)&KeyIntsType);
}

static int
push_ready(Walk *w, long long rank, PyObject *key)
{
    if (w->nready == w->ready_cap) {
        Py_ssize_t cap = w->ready_cap ? 2 * w->ready_cap : 16;
        Ready *ready = PyMem_Realloc(w->ready, cap * sizeof(Ready));
        if (ready == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        w->ready = ready;
        w->ready_cap = cap;
    }
    Py_ssize_t i = w->nready++;
    while (i > 0 && w->ready[(i - 1) / 2].rank > rank) {
        w->ready[i] = w->ready[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    w->ready[i].rank = rank;
    w->ready[i].key = Py_NewRef(key);
    return 0;
}

/* The key of least rank, taken off the heap (a new reference). */
static PyObject *
pop_ready(Walk *w)
{
    PyObject *key = w->ready[0].key;
    Ready last = w->ready[--w->nready];
    Py_ssize_t i = 0;
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= w->nready)
            break;
        if (child + 1 < w->nready && w->ready[child + 1].rank < w->ready[child].rank)
            child++;
        if (w->ready[child].rank >= last.rank)
            break;
        w->ready[i] = w->ready[child];
        i = child;
    }
    if (w->nready > 0)
        w->ready[i] = last;
    return key;
}

/* Whether ``protected(key)`` holds; -1 on an error, or when the call changed a list. */
static int
is_protected(Eviction *ev, PyObject *key)
{
    int yes;
    if (Py_TYPE(ev->protected) == &ProtectionType) {
        yes = protection_check((Protection *)ev->protected, key);
    }
    else {
        PyObject *answer = PyObject_CallOneArg(ev->protected, key);
        if (answer == NULL)
            return -1;
        yes = PyObject_IsTrue(answer);
        Py_DECREF(answer);
    }
    Lists *l = ev->lists;
    for (int i = 0; i < l->nlists; i++) {
        if (l->lists[i]->version != ev->versions[i]) {
            PyErr_SetString(PyExc_RuntimeError, "KeyOrder changed during eviction");
            return -1;
        }
    }
    return yes;
}

static long long
count_of(Table *t, PyObject *key, Py_hash_t hash)
{
    int32_t i = entry_of(t, key, hash);
    return i ? ENTRY(t, i)->value.num : 0;
}

/* The next key of walk ``w`` that may go (a new reference); NULL without an error when the
 * list has none left. */
static PyObject *
walk_next(Eviction *ev, int w)
{
    Walk *walk = &ev->walks[w];
    if (walk->nready)
        return pop_ready(walk);
    Table *list = ev->lists->lists[w];
    while (walk->at) {
        Entry *e = ENTRY(list, walk->at);
        PyObject *key = Py_NewRef(e->key);
        Py_hash_t hash = e->hash;
        walk->at = e->link[1];
        walk->seen++;
        int protected = is_protected(ev, key);
        if (protected) {
            Py_DECREF(key);
            if (protected < 0)
                return NULL;
            continue;
        }
        int32_t s = entry_of(ev->lists->successors, key, hash);
        if (s == 0 || ENTRY(ev->lists->successors, s)->value.num == count_of(ev->taken, key, hash))
            return key;
        int32_t *link = locate(walk->passed, key, hash);
        if (link != NULL)
            ENTRY(walk->passed, *link)->value.num = walk->seen;
        else if (append_new(walk->passed, key, hash, NULL, walk->seen) < 0) {
            Py_DECREF(key);
            return NULL;
        }
        Py_DECREF(key);
    }
    return NULL;
}

/* ``key`` has lost its last successor to the victims: 1 if it belongs to walk ``w``
 * (passed over, or parked from its list) and may go, 0 if not, -1 on an error. */
static int
walk_freed(Eviction *ev, int w, PyObject *key, Py_hash_t hash)
{
    Walk *walk = &ev->walks[w];
    PyObject *unused;
    long long rank;
    if (pop_entry(walk->passed, key, hash, &unused, &rank))
        return push_ready(walk, rank, key) < 0 ? -1 : 1;
    PyObject *parked = parked_entry(ev->lists, key);
    if (parked == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long place = PyLong_AsLong(PyTuple_GET_ITEM(parked, 0));
    if (place == -1 && PyErr_Occurred())
        return -1;
    if (place != ev->lists->places[w])
        return 0;
    int protected = is_protected(ev, key);
    if (protected)
        return protected < 0 ? -1 : 0;
    return push_ready(walk, --walk->parked_rank, key) < 0 ? -1 : 1;
}

/* The predecessor of resident ``key`` (borrowed), or NULL with an error. */
static PyObject *
parent_of(Lists *l, PyObject *key, Py_hash_t hash)
{
    for (int i = 0; i < l->nlists; i++) {
        int32_t at = entry_of(l->lists[i], key, hash);
        if (at)
            return ENTRY(l->lists[i], at)->value.obj;
    }
    PyObject *parked = parked_entry(l, key);
    if (parked == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyTuple_GET_ITEM(parked, 1);
}

/* Add victim ``key``; *freed is set to its predecessor (borrowed) if that has just lost
 * its last successor (policies/prefix.py's Victims.take). */
static int
take_victim(Eviction *ev, PyObject *key, PyObject **freed)
{
    *freed = NULL;
    if (PyList_Append(ev->victims, key) < 0)
        return -1;
    Py_hash_t hash = PyObject_Hash(key);
    PyObject *parent = parent_of(ev->lists, key, hash);
    if (parent == NULL)
        return -1;
    if (parent == Py_None)
        return 0;
    Py_hash_t parent_hash = PyObject_Hash(parent);
    int32_t i = entry_of(ev->taken, parent, parent_hash);
    long long taken;
    if (i)
        taken = ++ENTRY(ev->taken, i)->value.num;
    else if (append_new(ev->taken, parent, parent_hash, NULL, 1) == 0)
        taken = 1;
    else
        return -1;
    int32_t s = entry_of(ev->lists->successors, parent, parent_hash);
    if (s == 0) {
        PyErr_SetObject(PyExc_KeyError, parent);
        return -1;
    }
    if (taken == ENTRY(ev->lists->successors, s)->value.num)
        *freed = parent;
    return 0;
}

/* Choose ``n`` victims; 1 when found, 0 when the lists have too few, -1 on an error.
 * Nothing changes but the walks' own state. */
static int
choose(Eviction *ev, Py_ssize_t n, Py_ssize_t left_in_first)
{
    Lists *l = ev->lists;
    while (PyList_GET_SIZE(ev->victims) < n) {
        int w = l->nlists == 2 && !(left_in_first > 0 && (double)left_in_first > l->target);
        PyObject *key = walk_next(ev, w);
        if (key == NULL) {
            if (PyErr_Occurred())
                return -1;
            if (l->nlists == 1)
                return 0;
            w = !w;
            key = walk_next(ev, w);
            if (key == NULL)
                return PyErr_Occurred() ? -1 : 0;
        }
        if (w == 0)
            left_in_first--;
        PyObject *freed;
        int rc = take_victim(ev, key, &freed);
        Py_DECREF(key);
        if (rc < 0)
            return -1;
        if (freed != NULL) {
            Py_INCREF(freed);
            Py_hash_t hash = PyObject_Hash(freed);
            for (int i = 0; i < l->nlists && rc == 0; i++)
                rc = walk_freed(ev, i, freed, hash);
            Py_DECREF(freed);
            if (rc < 0)
                return -1;
        }
    }
    return 1;
}

/* Park each key its walk passed over (out of its list, into the parked keys). */
static int
park_passed(Eviction *ev)
{
    Lists *l = ev->lists;
    for (int w = 0; w < l->nlists; w++) {
        Table *passed = ev->walks[w].passed;
        for (int32_t i = passed->ends[0]; i;) {
            Entry *e = ENTRY(passed, i);
            i = e->link[1];
            PyObject *parent;
            long long ignored;
            if (!pop_entry(l->lists[w], e->key, e->hash, &parent, &ignored)) {
                PyErr_SetObject(PyExc_KeyError, e->key);
                return -1;
            }
            PyObject *place = PyLong_FromLong(l->places[w]);
            PyObject *value = place == NULL ? NULL : PyTuple_Pack(2, place, parent);
            Py_XDECREF(place);
            Py_DECREF(parent);
            if (value == NULL)
                return -1;
            int rc = PyDict_SetItem(l->parked, e->key, value);
            Py_DECREF(value);
            if (rc < 0 || add_parked_count(l, l->places[w], 1) < 0)
                return -1;
        }
    }
    return 0;
}

/* Take victim ``key`` out of its list (or the parked keys), into its ghost list if there
 * are ghosts, and unlink it from its predecessor. */
static int
evict_one(Lists *l, PyObject *key)
{
    Py_hash_t hash = PyObject_Hash(key);
    PyObject *parent = NULL;
    long long ignored;
    int w = 0;
    for (; w < l->nlists; w++) {
        if (pop_entry(l->lists[w], key, hash, &parent, &ignored))
            break;
    }
    if (w == l->nlists) {
        long place;
        if (unpark(l, key, 1, &place, &parent) < 0)
            return -1;
        w = list_index(l, place);
    }
    Table *ghosts = l->ghosts[w];
    if (ghosts != NULL && entry_of(ghosts, key, hash) == 0) {
        if (append_new(ghosts, key, hash, Py_None, 0) < 0) {
            Py_DECREF(parent);
            return -1;
        }
        while (ghosts->count > l->ghost_limit && ghosts->count)
            pop_oldest(ghosts);
    }
    int rc = unlink_parent(l, parent);
    Py_DECREF(parent);
    return rc;
}

/* evict(n, protected): ``n`` (> 1) victims by the policy's rule, taken out, or None
 * changing nothing (see policies/arc.py and policies/lru.py). */
static PyObject *
lists_evict(Lists *l, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("evict", nargs, 2, 2) < 0)
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[0]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    Eviction ev = {.lists = l, .protected = args[1]};
    Py_ssize_t left_in_first = 0;
    if (l->nlists == 2) {
        left_in_first = parked_count(l, l->places[0]);
        if (left_in_first == -1 && PyErr_Occurred())
            return NULL;
        left_in_first += l->lists[0]->count;
    }
    PyObject *result = NULL;
    int found = -1;
    ev.taken = new_ints();
    ev.victims = PyList_New(0);
    if (ev.taken == NULL || ev.victims == NULL)
        goto done;
    for (int w = 0; w < l->nlists; w++) {
        ev.walks[w].at = l->lists[w]->ends[0];
        ev.versions[w] = l->lists[w]->version;
        ev.walks[w].passed = new_ints();
        if (ev.walks[w].passed == NULL)
            goto done;
    }
    found = choose(&ev, n, left_in_first);
    if (found <= 0)
        goto done;
    if (park_passed(&ev) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ev.victims); i++) {
        if (evict_one(l, PyList_GET_ITEM(ev.victims, i)) < 0)
            goto done;
    }
    result = Py_NewRef(ev.victims);
done:
    if (found == 0 && !PyErr_Occurred())
        result = Py_NewRef(Py_None);
    for (int w = 0; w < 2; w++) {
        Walk *walk = &ev.walks[w];
        for (Py_ssize_t i = 0; i < walk->nready; i++)
            Py_DECREF(walk->ready[i].key);
        PyMem_Free(walk->ready);
        Py_XDECREF(walk->passed);
    }
    Py_XDECREF(ev.taken);
    Py_XDECREF(ev.victims);
    return result;
}

/* -- the type ------------------------------------------------------------------------ */

static int
table_arg(PyObject *obj, PyTypeObject *type, const char *what, Table **out)
{
    if (Py_TYPE(obj) != type) {
        PyErr_Format(PyExc_TypeError, "%s must be a %s, not %.100s", what, type->tp_name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = (Table *)obj;
    return 0;
}

/* A tuple of one or two tables of ``type`` (or None, when ``optional``). */
static int
tables_arg(PyObject *obj, PyTypeObject *type, const char *what, int optional, Table **out)
{
    if (optional && obj == Py_None)
        return 0;
    if (!PyTuple_CheckExact(obj) || PyTuple_GET_SIZE(obj) < 1 || PyTuple_GET_SIZE(obj) > 2) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple of one or two tables", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); i++) {
        if (table_arg(PyTuple_GET_ITEM(obj, i), type, what, &out[i]) < 0)
            return -1;
    }
    return (int)PyTuple_GET_SIZE(obj);
}

static PyObject *
lists_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"lists", "places", "successors", "parked", "parked_at", "ghosts", "ghost_limit",
                            "capacity", "error", NULL};
    PyObject *lists, *places, *successors, *parked, *parked_at, *ghosts = Py_None, *error = PyExc_ValueError;
    Py_ssize_t ghost_limit = 0, capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OO!O!|OnnO:PrefixLists", names, &PyTuple_Type, &lists,
                                     &PyTuple_Type, &places, &successors, &PyDict_Type, &parked, &PyList_Type,
                                     &parked_at, &ghosts, &ghost_limit, &capacity, &error))
        return NULL;
    if (!PyExceptionClass_Check(error)) {
        PyErr_SetString(PyExc_TypeError, "error must be an exception type");
        return NULL;
    }
    Lists *l = (Lists *)type->tp_alloc(type, 0);
    if (l == NULL)
        return NULL;
    Table *tables[2] = {NULL, NULL}, *ghost_tables[2] = {NULL, NULL}, *counts = NULL;
    int n = tables_arg(lists, &KeyOrderType, "lists", 0, tables);
    int g = n < 0 ? -1 : tables_arg(ghosts, &KeyOrderType, "ghosts", 1, ghost_tables);
    if (g < 0 || table_arg(successors, &KeyIntsType, "successors", &counts) < 0)
        goto fail;
    if ((g && g != n) || PyTuple_GET_SIZE(places) != n) {
        PyErr_SetString(PyExc_ValueError, "one place (and ghost list) per list");
        goto fail;
    }
    l->nlists = n;
    for (int i = 0; i < n; i++) {
        long place = PyLong_AsLong(PyTuple_GET_ITEM(places, i));
        if (place == -1 && PyErr_Occurred())
            goto fail;
        if (place < 0 || place >= PyList_GET_SIZE(parked_at)) {
            PyErr_SetString(PyExc_ValueError, "parked_at must count every place");
            goto fail;
        }
        l->places[i] = place;
        l->lists[i] = (Table *)Py_NewRef(tables[i]);
        l->ghosts[i] = (Table *)Py_XNewRef(ghost_tables[i]);
    }
    l->successors = (Table *)Py_NewRef(counts);
    l->parked = Py_NewRef(parked);
    l->parked_at = Py_NewRef(parked_at);
    l->error = Py_NewRef(error);
    l->ghost_limit = ghost_limit;
    l->capacity = capacity;
    return (PyObject *)l;
fail:
    Py_DECREF(l);
    return NULL;
}

/* Hand the walk another parked dict (a clearing policy's new, empty one); the old one,
 * returned, is the caller's to let go of, a step at a time. */
static PyObject *
lists_swap_parked(Lists *l, PyObject *parked)
{
    if (!PyDict_Check(parked)) {
        PyErr_Format(PyExc_TypeError, "parked keys are a dict, not %.100s", Py_TYPE(parked)->tp_name);
        return NULL;
    }
    PyObject *old = l->parked;
    l->parked = Py_NewRef(parked);
    return old; /* our reference, handed over */
}

static void
lists_dealloc(Lists *l)
{
    for (int i = 0; i < 2; i++) {
        Py_XDECREF(l->lists[i]);
        Py_XDECREF(l->ghosts[i]);
    }
    Py_XDECREF(l->successors);
    Py_XDECREF(l->parked);
    Py_XDECREF(l->parked_at);
    Py_XDECREF(l->error);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static PyMethodDef lists_methods[] = {
    {"evict", (PyCFunction)(void (*)(void))lists_evict, METH_FASTCALL,
     "evict(n, protected): n (> 1) victims, taken out, or None changing nothing"},
    {"touch", (PyCFunction)lists_touch, METH_O, "touch(key): a hit; key becomes the newest of the last list"},
    {"lru_insert", (PyCFunction)(void (*)(void))lists_lru_insert, METH_FASTCALL,
     "lru_insert(key, parent=None): LRU's insert of a new key"},
    {"arc_insert", (PyCFunction)(void (*)(void))lists_arc_insert, METH_FASTCALL,
     "arc_insert(key, parent=None): ARC's insert of a new key"},
    {"swap_parked", (PyCFunction)lists_swap_parked, METH_O,
     "swap_parked(parked): walk over the dict parked from now on; the one it walked over before"},
    {NULL, NULL},
};

static PyMemberDef lists_members[] = {
    {"target", T_DOUBLE, offsetof(Lists, target), 0, "ARC's target size of its first list"},
    {NULL},
};

static PyTypeObject ListsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tiered_kv._keytable.PrefixLists",
    .tp_basicsize = sizeof(Lists),
    .tp_dealloc = (destructor)lists_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "PrefixLists(lists, places, successors, parked, parked_at, ghosts=None, ghost_limit=0, capacity=0, "
              "error=ValueError): the eviction walk and ARC's insert over a prefix-aware policy's tables.",
    .tp_methods = lists_methods,
    .tp_members = lists_members,
    .tp_new = lists_new,
};

/* -- which keys an eviction passes over (tiered_kv/directory.py) --------------------- */

/* A residency index's answer to "must this key stay?" for one eviction: a key it keeps
 * for the store at hand (``kept``, ``keep``), one it does not hold, or one whose chunk is
 * pinned, not READY, or leased in the current epoch. Read from the index's own arrays;
 * the eviction walk asks it without a Python call. */
struct Protection {
    PyObject_HEAD
    Table *table; /* key -> slot (a KeyInts) */
    Py_buffer state, pins, lease; /* lease.obj == NULL: the tier takes no leases */
    long long epoch;
    PyObject *kept, *keep; /* NULL: none */
    unsigned char ready; /* the state of a slot whose chunk can be read (the index's READY) */
};

/* 1 if ``key`` must stay, 0 if it may go, -1 on an error. */
static int
protection_check(Protection *p, PyObject *key)
{
    int yes;
    if (p->kept != NULL && (yes = PySequence_Contains(p->kept, key)) != 0)
        return yes;
    if (p->keep != NULL && (yes = PySequence_Contains(p->keep, key)) != 0)
        return yes;
    int32_t i = find(p->table, key);
    if (i <= 0)
        return i < 0 ? -1 : 1;
    long long slot = ENTRY(p->table, i)->value.num;
    if (slot < 0 || slot >= p->state.len || slot >= p->pins.len / 2 || (p->lease.obj && slot >= p->lease.len / 4)) {
        PyErr_Format(PyExc_IndexError, "slot %lld is outside the index's arrays", slot);
        return -1;
    }
    return ((uint16_t *)p->pins.buf)[slot] > 0 || ((unsigned char *)p->state.buf)[slot] != p->ready
           || (p->lease.obj != NULL && ((int32_t *)p->lease.buf)[slot] == p->epoch);
}

static PyObject *
protection_call(Protection *p, PyObject *args, PyObject *kwargs)
{
    PyObject *key;
    if (!PyArg_ParseTuple(args, "O:Protection", &key))
        return NULL;
    int yes = protection_check(p, key);
    return yes < 0 ? NULL : PyBool_FromLong(yes);
}

/* A buffer of ``obj`` with items of ``format`` (one character); -1 with an error if not. */
static int
typed_buffer(PyObject *obj, const char *format, Py_ssize_t itemsize, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->itemsize != itemsize || view->format == NULL || strcmp(view->format, format) != 0) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_Format(PyExc_TypeError, "expected an array of '%s' items", format);
        return -1;
    }
    return 0;
}

static PyObject *
protection_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"slots", "state", "pins", "lease", "epoch", "kept", "keep", "ready", NULL};
    PyObject *slots, *state, *pins, *lease, *kept, *keep;
    long long epoch;
    unsigned char ready;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOOLOOb:Protection", names, &KeyIntsType, &slots, &state,
                                     &pins, &lease, &epoch, &kept, &keep, &ready))
        return NULL;
    Protection *p = (Protection *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    if (typed_buffer(state, "B", 1, &p->state) < 0
        || typed_buffer(pins, "H", 2, &p->pins) < 0 || (lease != Py_None && typed_buffer(lease, "i", 4, &p->lease) < 0)) {
        Py_DECREF(p);
        return NULL;
    }
    p->table = (Table *)Py_NewRef(slots);
    p->epoch = epoch;
    p->ready = ready;
    p->kept = kept == Py_None ? NULL : Py_NewRef(kept);
    p->keep = keep == Py_None ? NULL : Py_NewRef(keep);
    return (PyObject *)p;
}

static void
protection_dealloc(Protection *p)
{
    Py_buffer *views[] = {&p->state, &p->pins, &p->lease};
    for (int i = 0; i < 3; i++) {
        if (views[i]->obj != NULL)
            PyBuffer_Release(views[i]);
    }
    Py_XDECREF(p->table);
    Py_XDECREF(p->kept);
    Py_XDECREF(p->keep);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyTypeObject ProtectionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tiered_kv._keytable.Protection",
    .tp_basicsize = sizeof(Protection),
    .tp_dealloc = (destructor)protection_dealloc,
    .tp_call = (ternaryfunc)protection_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Protection(slots, state, pins, lease, epoch, kept, keep, ready): whether an eviction must pass a key over.",
    .tp_new = protection_new,
};

/* -- a residency index's per-slot records (tiered_kv/directory.py) ------------------- */

/* The most pins or hits a slot counts (the index's _MAX_COUNT), and the length of a
 * chunk key, which each slot's record of its predecessor holds. */
#define MAX_COUNT 0xFFFF
#define KEY_BYTES 16

/* The per-chunk steps of a residency index over its own arrays: its key -> slot table,
 * each slot's state, pins, hits and lease, namespace number and predecessor, and the
 * namespaces' names and counts of chunks. One call per batch of a store or a load runs
 * what was a Python step per chunk; the index keeps the same objects for its colder
 * steps. Holds no reference to the index, so no cycle passes through it. */
typedef struct {
    PyObject_HEAD
    Table *slots;
    Py_buffer state, pins, hits, lease, namespace, parent, has_parent; /* hits, lease: obj NULL if not kept */
    Py_buffer children; /* each slot's chunk's resident successors: the chunks naming it as predecessor */
    Py_ssize_t size; /* slots in each array */
    PyObject *names; /* list: each namespace number's name (None: unused) */
    PyObject *held_by; /* list: the chunks holding each number */
    PyObject *other_owner; /* dict: slot -> the share a chunk counts in, where not its namespace */
    PyObject *orphans; /* dict: a key not resident -> the resident chunks still naming it as predecessor */
    PyObject *victim; /* the type of an evicted chunk's record */
    PyObject *tier; /* str: the tier, in messages */
    PyObject *error; /* the exception type of a misuse */
    unsigned char ready;
    Py_ssize_t pinned; /* chunks with at least one pin */
} Records;

#define U8(view) ((unsigned char *)(view).buf)
#define U16(view) ((uint16_t *)(view).buf)
#define I32(view) ((int32_t *)(view).buf)
#define U32(view) ((uint32_t *)(view).buf)

/* Take resident ``key`` out of the table (found again: making its record may have run a
 * collection). */
static int
pop_key(Records *r, PyObject *key)
{
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1)
        return -1;
    int32_t *link = locate(r->slots, key, hash);
    if (link == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    long long ignored;
    take(r->slots, link, &ignored);
    return 0;
}

/* Raise the index's error "<tier>: chunk <hex> <what>"; NULL. */
static PyObject *
chunk_error(Records *r, PyObject *key, const char *what)
{
    PyObject *hex = PyObject_CallMethod(key, "hex", NULL);
    if (hex != NULL) {
        PyErr_Format(r->error, "%U: chunk %U %s", r->tier, hex, what);
        Py_DECREF(hex);
    }
    return NULL;
}

/* The slot of ``key`` (-1: not resident; -2 with an error). */
static Py_ssize_t
slot_of(Records *r, PyObject *key)
{
    int32_t i = find(r->slots, key);
    if (i <= 0)
        return i < 0 ? -2 : -1;
    long long slot = ENTRY(r->slots, i)->value.num;
    if (slot < 0 || slot >= r->size) {
        PyErr_Format(PyExc_IndexError, "slot %lld is outside the index's arrays", slot);
        return -2;
    }
    return (Py_ssize_t)slot;
}

/* The slot of resident ``key``; -1 with the index's error if it is not resident. */
static Py_ssize_t
resident_slot(Records *r, PyObject *key)
{
    Py_ssize_t slot = slot_of(r, key);
    if (slot == -1)
        chunk_error(r, key, "is not resident");
    return slot < 0 ? -1 : slot;
}

/* The name of namespace number ``ns`` (borrowed), or NULL with an error. */
static PyObject *
name_of(Records *r, uint32_t ns)
{
    if (ns >= (size_t)PyList_GET_SIZE(r->names) || PyList_GET_ITEM(r->names, ns) == Py_None) {
        PyErr_Format(PyExc_IndexError, "namespace number %u is not in use", (unsigned)ns);
        return NULL;
    }
    return PyList_GET_ITEM(r->names, ns);
}

/* The share the chunk in ``slot`` counts in (borrowed): its other owner, else its namespace. */
static PyObject *
owner_of(Records *r, Py_ssize_t slot)
{
    if (PyDict_GET_SIZE(r->other_owner)) {
        PyObject *number = PyLong_FromSsize_t(slot);
        if (number == NULL)
            return NULL;
        PyObject *owner = PyDict_GetItemWithError(r->other_owner, number);
        Py_DECREF(number);
        if (owner != NULL && PyObject_IsTrue(owner) == 1)
            return owner;
        if (PyErr_Occurred())
            return NULL;
    }
    return name_of(r, U32(r->namespace)[slot]);
}

/* Count ``n`` fewer chunks of number ``ns``; a number no chunk holds any more is
 * appended to ``forgotten``, for the index to make free. */
static int
release_number(Records *r, uint32_t ns, Py_ssize_t n, PyObject *forgotten)
{
    if (n == 0)
        return 0;
    if (ns >= (size_t)PyList_GET_SIZE(r->held_by)) {
        PyErr_Format(PyExc_IndexError, "namespace number %u is not counted", (unsigned)ns);
        return -1;
    }
    Py_ssize_t held = PyLong_AsSsize_t(PyList_GET_ITEM(r->held_by, ns));
    if (held == -1 && PyErr_Occurred())
        return -1;
    PyObject *now = PyLong_FromSsize_t(held - n);
    if (now == NULL)
        return -1;
    PyList_SetItem(r->held_by, ns, now); /* steals ``now`` */
    if (held - n)
        return 0;
    PyObject *number = PyLong_FromUnsignedLong(ns);
    int rc = number == NULL ? -1 : PyList_Append(forgotten, number);
    Py_XDECREF(number);
    return rc;
}

/* Count ``key`` (not resident) as named by one resident successor less. */
static int
orphan_leaves(Records *r, PyObject *key)
{
    PyObject *count = PyDict_GetItemWithError(r->orphans, key);
    if (count == NULL)
        return PyErr_Occurred() ? -1 : 0; /* not counted: check() reports it */
    Py_ssize_t left = PyLong_AsSsize_t(count) - 1;
    if (left == -2 && PyErr_Occurred())
        return -1;
    if (left <= 0)
        return PyDict_DelItem(r->orphans, key);
    PyObject *now = PyLong_FromSsize_t(left);
    int rc = now == NULL ? -1 : PyDict_SetItem(r->orphans, key, now);
    Py_XDECREF(now);
    return rc;
}

/* The chunk in ``slot`` leaves: its predecessor counts a resident successor less (in
 * ``children`` if resident, else in the orphans), and if resident chunks still continue
 * it, ``key`` goes into the orphans with their number, so that a later copy of the key
 * is not made to continue one of them. */
static int
unlink_slot(Records *r, Py_ssize_t slot, PyObject *key)
{
    if (U8(r->has_parent)[slot]) {
        PyObject *parent = PyBytes_FromStringAndSize((char *)U8(r->parent) + KEY_BYTES * slot, KEY_BYTES);
        if (parent == NULL)
            return -1;
        Py_ssize_t at = slot_of(r, parent);
        int rc = at >= 0 ? 0 : at == -1 ? orphan_leaves(r, parent) : -1;
        if (at >= 0 && U32(r->children)[at])
            U32(r->children)[at]--;
        Py_DECREF(parent);
        if (rc < 0)
            return -1;
    }
    uint32_t successors = U32(r->children)[slot];
    U32(r->children)[slot] = 0;
    if (successors == 0)
        return 0;
    PyObject *count = PyLong_FromUnsignedLong(successors);
    int rc = count == NULL ? -1 : PyDict_SetItem(r->orphans, key, count);
    Py_XDECREF(count);
    return rc;
}

/* Clear what the index keeps of the chunk in ``slot`` (of ``key``), counting its
 * namespace number out in runs (``*run_ns``, ``*run``: the number and count not yet
 * released). */
static int
clear_slot(Records *r, Py_ssize_t slot, PyObject *key, uint32_t *run_ns, Py_ssize_t *run, PyObject *forgotten)
{
    if (unlink_slot(r, slot, key) < 0)
        return -1;
    uint32_t ns = U32(r->namespace)[slot];
    if (ns != *run_ns) {
        if (release_number(r, *run_ns, *run, forgotten) < 0)
            return -1;
        *run_ns = ns;
        *run = 0;
    }
    (*run)++;
    U8(r->state)[slot] = 0;
    U8(r->has_parent)[slot] = 0;
    U32(r->namespace)[slot] = 0;
    if (r->hits.obj != NULL)
        U16(r->hits)[slot] = 0;
    if (r->lease.obj != NULL)
        I32(r->lease)[slot] = 0;
    if (PyDict_GET_SIZE(r->other_owner)) {
        PyObject *number = PyLong_FromSsize_t(slot);
        if (number == NULL)
            return -1;
        int had = PyDict_Contains(r->other_owner, number);
        int rc = had <= 0 ? had : PyDict_DelItem(r->other_owner, number);
        Py_DECREF(number);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* A slot number of ``obj`` inside the arrays, or -1 with an error. */
static Py_ssize_t
slot_arg(Records *r, PyObject *obj)
{
    Py_ssize_t slot = PyLong_AsSsize_t(obj);
    if (slot == -1 && PyErr_Occurred())
        return -1;
    if (slot < 0 || slot >= r->size) {
        PyErr_Format(PyExc_IndexError, "slot %zd is outside the index's arrays", slot);
        return -1;
    }
    return slot;
}

/* The record of the chunk in ``slot`` as evicted or copied: a ``victim`` of its key, slot,
 * ``owner``, namespace and predecessor (a new reference). */
static PyObject *
make_victim(Records *r, PyObject *key, Py_ssize_t slot, PyObject *owner)
{
    PyObject *namespace = name_of(r, U32(r->namespace)[slot]);
    if (namespace == NULL)
        return NULL;
    PyObject *parent = U8(r->has_parent)[slot]
                           ? PyBytes_FromStringAndSize((char *)U8(r->parent) + KEY_BYTES * slot, KEY_BYTES)
                           : Py_NewRef(Py_None);
    PyObject *number = PyLong_FromSsize_t(slot);
    PyObject *victim = NULL;
    if (parent != NULL && number != NULL) {
        PyObject *args[] = {key, number, owner, namespace, parent};
        victim = PyObject_Vectorcall(r->victim, args, 5, NULL);
    }
    Py_XDECREF(parent);
    Py_XDECREF(number);
    return victim;
}

/* evict(victims): take each key of ``victims`` (owner -> keys, as a partition's
 * make_room gives them) out of the table and clear its slot; (their records, in order;
 * their slots; the namespace numbers no chunk holds any more). */
static PyObject *
records_evict(Records *r, PyObject *victims)
{
    if (!PyDict_Check(victims)) {
        PyErr_SetString(PyExc_TypeError, "evict() takes a dict of owner -> keys");
        return NULL;
    }
    PyObject *records = PyList_New(0), *slots = PyList_New(0), *forgotten = PyList_New(0), *result = NULL;
    PyObject *owners = PyDict_Items(victims); /* a copy: making records runs no Python code, but be safe */
    uint32_t run_ns = 0;
    Py_ssize_t run = 0;
    if (records == NULL || slots == NULL || forgotten == NULL || owners == NULL)
        goto done;
    for (Py_ssize_t o = 0; o < PyList_GET_SIZE(owners); o++) {
        PyObject *owner = PyTuple_GET_ITEM(PyList_GET_ITEM(owners, o), 0);
        PyObject *keys = PySequence_Fast(PyTuple_GET_ITEM(PyList_GET_ITEM(owners, o), 1), "victims are lists of keys");
        if (keys == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(keys); i++) {
            PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
            Py_ssize_t slot = resident_slot(r, key);
            PyObject *victim = slot < 0 ? NULL : make_victim(r, key, slot, owner);
            PyObject *number = victim == NULL ? NULL : PyLong_FromSsize_t(slot);
            int rc = number == NULL ? -1 : PyList_Append(records, victim);
            if (rc == 0)
                rc = PyList_Append(slots, number);
            Py_XDECREF(victim);
            Py_XDECREF(number);
            if (rc == 0)
                rc = pop_key(r, key);
            if (rc == 0)
                rc = clear_slot(r, slot, key, &run_ns, &run, forgotten);
            if (rc < 0) {
                Py_DECREF(keys);
                goto done;
            }
        }
        Py_DECREF(keys);
    }
    if (release_number(r, run_ns, run, forgotten) == 0)
        result = PyTuple_Pack(3, records, slots, forgotten);
done:
    Py_XDECREF(records);
    Py_XDECREF(slots);
    Py_XDECREF(forgotten);
    Py_XDECREF(owners);
    return result;
}

/* occupy(keys, slots, ns, state, parent_of, insert, owner, other): record each of ``keys``
 * (none resident) in its slot, in ``state``, of namespace number ``ns``, after
 * ``insert(key, parent)`` told the owner's policy; its predecessor
 * ``parent_of(key)`` is kept only if resident already and the key is no orphan (see
 * TierIndex._occupy_many), its bytes written into the free slot first, so that one of the
 * wrong length changes nothing; it counts the key among its resident successors.
 * ``other``: the chunks count in ``owner``'s share, not their namespace's. On an error the
 * keys before the failing one stay recorded. */
static PyObject *
records_occupy(Records *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("occupy", nargs, 8, 8) < 0)
        return NULL;
    PyObject *parent_of = args[4], *insert = args[5], *owner = args[6];
    unsigned long ns = PyLong_AsUnsignedLong(args[2]);
    long state = PyLong_AsLong(args[3]);
    int other = PyObject_IsTrue(args[7]);
    if ((ns == (unsigned long)-1 || state == -1 || other < 0) && PyErr_Occurred())
        return NULL;
    if (ns == 0 || ns >= (size_t)PyList_GET_SIZE(r->names) || state <= 0 || state > 255) {
        PyErr_SetString(PyExc_ValueError, "occupy() takes a namespace number in use and a state not free");
        return NULL;
    }
    PyObject *keys = PySequence_Fast(args[0], "occupy() takes a sequence of keys");
    PyObject *slots = keys == NULL ? NULL : PySequence_Fast(args[1], "occupy() takes a sequence of slots");
    if (slots == NULL || PySequence_Fast_GET_SIZE(keys) != PySequence_Fast_GET_SIZE(slots)) {
        if (slots != NULL)
            PyErr_SetString(PyExc_ValueError, "occupy() takes a slot per key");
        Py_XDECREF(keys);
        Py_XDECREF(slots);
        return NULL;
    }
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(keys); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        Py_ssize_t slot = slot_arg(r, PySequence_Fast_GET_ITEM(slots, i));
        if (slot < 0 || check_key(key) < 0)
            goto done;
        /* Resident chunks that continue an earlier copy of the key (one dropped) make it
         * a predecessor already: a link from it could close a cycle, never evictable. */
        PyObject *successors = PyDict_GetItemWithError(r->orphans, key);
        if (successors == NULL && PyErr_Occurred())
            goto done;
        PyObject *parent = successors != NULL ? Py_NewRef(Py_None) : PyObject_CallOneArg(parent_of, key);
        if (parent == NULL)
            goto done;
        Py_ssize_t parent_slot = -1;
        if (parent != Py_None) {
            parent_slot = slot_of(r, parent);
            if (parent_slot == -2) {
                Py_DECREF(parent);
                goto done;
            }
            if (parent_slot == -1)
                Py_SETREF(parent, Py_NewRef(Py_None));
        }
        uint32_t continued = 0;
        if (successors != NULL) {
            unsigned long count = PyLong_AsUnsignedLong(successors);
            if (count == (unsigned long)-1 && PyErr_Occurred()) {
                Py_DECREF(parent);
                goto done;
            }
            continued = (uint32_t)count;
        }
        if (parent != Py_None) {
            if (PyBytes_GET_SIZE(parent) != KEY_BYTES) {
                PyErr_Format(PyExc_ValueError, "a predecessor is a key of %d bytes, not %zd", KEY_BYTES,
                             PyBytes_GET_SIZE(parent));
                Py_DECREF(parent);
                goto done;
            }
            memcpy(U8(r->parent) + KEY_BYTES * slot, PyBytes_AS_STRING(parent), KEY_BYTES);
        }
        PyObject *call[] = {key, parent};
        PyObject *inserted = PyObject_Vectorcall(insert, call, 2, NULL);
        int has_parent = parent != Py_None;
        Py_DECREF(parent);
        if (inserted == NULL)
            goto done;
        Py_DECREF(inserted);
        PyObject *number = PyLong_FromSsize_t(slot);
        int rc = number == NULL ? -1 : set_item(r->slots, key, number);
        if (rc == 0 && other)
            rc = PyDict_SetItem(r->other_owner, number, owner);
        Py_XDECREF(number);
        if (rc < 0)
            goto done;
        U8(r->state)[slot] = (unsigned char)state;
        U32(r->namespace)[slot] = (uint32_t)ns;
        U8(r->has_parent)[slot] = (unsigned char)has_parent;
        if (has_parent)
            U32(r->children)[parent_slot]++;
        if (continued) { /* its successors continue this copy of it now */
            U32(r->children)[slot] = continued;
            if (PyDict_DelItem(r->orphans, key) < 0)
                goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(keys);
    Py_DECREF(slots);
    return result;
}

/* mark_ready(keys): each of ``keys`` (PENDING) becomes READY; the namespaces they belong
 * to, in order. The keys before one not resident or already READY stay READY. */
static PyObject *
records_mark_ready(Records *r, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "mark_ready() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *names = PyList_New(n);
    for (Py_ssize_t i = 0; names != NULL && i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t slot = resident_slot(r, key);
        PyObject *name = slot < 0 ? NULL : name_of(r, U32(r->namespace)[slot]);
        if (name != NULL && U8(r->state)[slot] == r->ready) {
            chunk_error(r, key, "is already ready");
            name = NULL;
        }
        if (name == NULL) {
            Py_CLEAR(names);
            break;
        }
        U8(r->state)[slot] = r->ready;
        PyList_SET_ITEM(names, i, Py_NewRef(name));
    }
    Py_DECREF(seq);
    return names;
}

/* Take one pin off each of the first ``n`` of ``keys`` (all pinned). */
static void
unpin_first(Records *r, PyObject *seq, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t slot = slot_of(r, PySequence_Fast_GET_ITEM(seq, i));
        if (slot >= 0 && U16(r->pins)[slot] && !--U16(r->pins)[slot])
            r->pinned--;
    }
}

/* ready_run(keys, ns, start, stop): the first position in ``start`` … ``stop`` − 1 whose key
 * is not READY for namespace number ``ns`` (``stop`` when all are); the lookup's hot loop. */
static PyObject *
records_ready_run(Records *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("ready_run", nargs, 4, 4) < 0)
        return NULL;
    long long ns = PyLong_AsLongLong(args[1]);
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    Py_ssize_t stop = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "ready_run() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    if (start < 0 || stop > PySequence_Fast_GET_SIZE(seq)) {
        PyErr_Format(PyExc_IndexError, "positions %zd to %zd are not all in a run of %zd keys", start, stop,
                     PySequence_Fast_GET_SIZE(seq));
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t i = start;
    for (; i < stop; i++) {
        Py_ssize_t slot = slot_of(r, PySequence_Fast_GET_ITEM(seq, i));
        if (slot == -2) {
            Py_DECREF(seq);
            return NULL;
        }
        if (slot < 0 || U8(r->state)[slot] != r->ready || U32(r->namespace)[slot] != ns)
            break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(i < stop ? i : stop);
}

/* pin_ready_run(keys, ns): pin the leading run of ``keys`` READY for namespace number
 * ``ns``; how many. A pin past the most a slot counts takes the run's pins back off. */
static PyObject *
records_pin_ready_run(Records *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("pin_ready_run", nargs, 2, 2) < 0)
        return NULL;
    long long ns = PyLong_AsLongLong(args[1]);
    if (ns == -1 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "pin_ready_run() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = 0;
    for (; n < PySequence_Fast_GET_SIZE(seq); n++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, n);
        Py_ssize_t slot = slot_of(r, key);
        if (slot == -2) {
            unpin_first(r, seq, n);
            Py_DECREF(seq);
            return NULL;
        }
        if (slot < 0 || U8(r->state)[slot] != r->ready || U32(r->namespace)[slot] != ns)
            break;
        uint16_t count = U16(r->pins)[slot];
        if (count >= MAX_COUNT) {
            unpin_first(r, seq, n);
            char what[48];
            snprintf(what, sizeof what, "has %u pins already", (unsigned)count);
            chunk_error(r, key, what);
            Py_DECREF(seq);
            return NULL;
        }
        if (!count)
            r->pinned++;
        U16(r->pins)[slot] = count + 1;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(n);
}

/* pin_for_copy(keys): pin each of ``keys`` (resident) while its bytes are copied out of
 * the tier; the record of each (its key, slot, owner, namespace and predecessor), in
 * order. On an error no key is left pinned by the call. */
static PyObject *
records_pin_for_copy(Records *r, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "pin_for_copy() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    PyObject *records = PyList_New(n);
    for (; records != NULL && i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t slot = resident_slot(r, key);
        if (slot < 0)
            break;
        uint16_t count = U16(r->pins)[slot];
        if (count >= MAX_COUNT) {
            char what[48];
            snprintf(what, sizeof what, "has %u pins already", (unsigned)count);
            chunk_error(r, key, what);
            break;
        }
        PyObject *owner = owner_of(r, slot);
        PyObject *victim = owner == NULL ? NULL : make_victim(r, key, slot, owner);
        if (victim == NULL)
            break;
        PyList_SET_ITEM(records, i, victim);
        if (!count)
            r->pinned++;
        U16(r->pins)[slot] = count + 1;
    }
    if (records != NULL && i < n) { /* an error: the pins taken go back */
        unpin_first(r, seq, i);
        Py_CLEAR(records);
    }
    Py_DECREF(seq);
    return records;
}

/* unpin_many(keys): one pin off each of ``keys``; the keys before one not pinned stay unpinned. */
static PyObject *
records_unpin_many(Records *r, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "unpin_many() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    PyObject *result = Py_None;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t slot = slot_of(r, key);
        if (slot == -1 || (slot >= 0 && !U16(r->pins)[slot]))
            chunk_error(r, key, "is not pinned");
        if (PyErr_Occurred()) {
            result = NULL;
            break;
        }
        if (!--U16(r->pins)[slot])
            r->pinned--;
    }
    Py_DECREF(seq);
    return Py_XNewRef(result);
}

/* slots_of(keys): the slots of resident ``keys``, in order. */
static PyObject *
records_slots_of(Records *r, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "slots_of() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *slots = PyList_New(n);
    for (Py_ssize_t i = 0; slots != NULL && i < n; i++) {
        Py_ssize_t slot = resident_slot(r, PySequence_Fast_GET_ITEM(seq, i));
        PyObject *number = slot < 0 ? NULL : PyLong_FromSsize_t(slot);
        if (number == NULL)
            Py_CLEAR(slots);
        else
            PyList_SET_ITEM(slots, i, number);
    }
    Py_DECREF(seq);
    return slots;
}

/* hit_many(keys, policy_of): a hit on each of ``keys`` (resident): ``touch(key)`` of the
 * policy ``policy_of(owner)`` of its owner, then one more on its hit count (up to the
 * most a slot counts); the new counts, in order (none if the index counts no hits). A
 * key not resident raises KeyError(key); the keys before it are counted. */
static PyObject *
records_hit_many(Records *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_count("hit_many", nargs, 2, 2) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "hit_many() takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    PyObject *counts = PyList_New(0), *touched_by = NULL, *touch = NULL;
    for (Py_ssize_t i = 0; counts != NULL && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t slot = slot_of(r, key);
        if (slot == -1)
            PyErr_SetObject(PyExc_KeyError, key);
        PyObject *owner = slot < 0 ? NULL : owner_of(r, slot);
        int same = owner == NULL ? -1 : touched_by == NULL ? 0 : PyObject_RichCompareBool(owner, touched_by, Py_EQ);
        if (same == 0) {
            /* the owner whose policy ``touch`` is (they are usually all one) */
            Py_XSETREF(touched_by, Py_NewRef(owner));
            PyObject *policy = PyObject_CallOneArg(args[1], owner);
            Py_XSETREF(touch, policy == NULL ? NULL : PyObject_GetAttrString(policy, "touch"));
            Py_XDECREF(policy);
            same = touch == NULL ? -1 : 1;
        }
        PyObject *touched = same < 0 ? NULL : PyObject_CallOneArg(touch, key);
        if (touched == NULL) {
            Py_CLEAR(counts);
            break;
        }
        Py_DECREF(touched);
        if (r->hits.obj == NULL)
            continue;
        uint16_t *hits = &U16(r->hits)[slot];
        if (*hits < MAX_COUNT)
            (*hits)++;
        PyObject *count = PyLong_FromLong(*hits);
        if (count == NULL || PyList_Append(counts, count) < 0)
            Py_CLEAR(counts);
        Py_XDECREF(count);
    }
    Py_XDECREF(touched_by);
    Py_XDECREF(touch);
    Py_DECREF(seq);
    return counts;
}

/* A buffer of ``obj`` with ``per_slot`` items of ``format`` for each of ``size`` slots. */
static int
slot_buffer(PyObject *obj, const char *format, Py_ssize_t itemsize, Py_ssize_t per_slot, Py_ssize_t size,
            Py_buffer *view)
{
    if (typed_buffer(obj, format, itemsize, view) < 0)
        return -1;
    if (view->readonly || view->len != size * per_slot * itemsize) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_Format(PyExc_ValueError, "expected a writable array of %zd '%s' items", size * per_slot, format);
        return -1;
    }
    return 0;
}

static PyObject *
records_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"slots", "state", "pins", "hits", "lease", "namespace", "parent", "has_parent",
                            "children", "names", "held_by", "other_owner", "orphans", "victim", "tier", "error",
                            "ready", NULL};
    PyObject *slots, *state, *pins, *hits, *lease, *namespace, *parent, *has_parent, *children, *names_list, *held_by,
        *other_owner, *orphans, *victim, *tier, *error;
    unsigned char ready;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOOOOOOOO!O!O!O!OUOb:SlotRecords", names, &KeyIntsType, &slots,
                                     &state, &pins, &hits, &lease, &namespace, &parent, &has_parent, &children,
                                     &PyList_Type, &names_list, &PyList_Type, &held_by, &PyDict_Type, &other_owner,
                                     &PyDict_Type, &orphans, &victim, &tier, &error, &ready))
        return NULL;
    if (!PyCallable_Check(victim) || !PyExceptionClass_Check(error)) {
        PyErr_SetString(PyExc_TypeError, "victim must be callable and error an exception type");
        return NULL;
    }
    Records *r = (Records *)type->tp_alloc(type, 0);
    if (r == NULL)
        return NULL;
    /* The state's length is the arrays' size: found, then checked like the others'. */
    if (typed_buffer(state, "B", 1, &r->state) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    r->size = r->state.len;
    PyBuffer_Release(&r->state);
    r->state.obj = NULL;
    if (slot_buffer(state, "B", 1, 1, r->size, &r->state) < 0 || slot_buffer(pins, "H", 2, 1, r->size, &r->pins) < 0
        || (hits != Py_None && slot_buffer(hits, "H", 2, 1, r->size, &r->hits) < 0)
        || (lease != Py_None && slot_buffer(lease, "i", 4, 1, r->size, &r->lease) < 0)
        || slot_buffer(namespace, "I", 4, 1, r->size, &r->namespace) < 0
        || slot_buffer(parent, "B", 1, KEY_BYTES, r->size, &r->parent) < 0
        || slot_buffer(has_parent, "B", 1, 1, r->size, &r->has_parent) < 0
        || slot_buffer(children, "I", 4, 1, r->size, &r->children) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    r->slots = (Table *)Py_NewRef(slots);
    r->names = Py_NewRef(names_list);
    r->held_by = Py_NewRef(held_by);
    r->other_owner = Py_NewRef(other_owner);
    r->orphans = Py_NewRef(orphans);
    r->victim = Py_NewRef(victim);
    r->tier = Py_NewRef(tier);
    r->error = Py_NewRef(error);
    r->ready = ready;
    return (PyObject *)r;
}

static void
records_dealloc(Records *r)
{
    Py_buffer *views[] = {&r->state,  &r->pins,       &r->hits,    &r->lease,
                          &r->namespace, &r->parent, &r->has_parent, &r->children};
    for (size_t i = 0; i < sizeof views / sizeof views[0]; i++) {
        if (views[i]->obj != NULL)
            PyBuffer_Release(views[i]);
    }
    Py_XDECREF(r->slots);
    Py_XDECREF(r->names);
    Py_XDECREF(r->held_by);
    Py_XDECREF(r->other_owner);
    Py_XDECREF(r->orphans);
    Py_XDECREF(r->victim);
    Py_XDECREF(r->tier);
    Py_XDECREF(r->error);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef records_methods[] = {
    {"evict", (PyCFunction)records_evict, METH_O,
     "evict(victims): owner -> keys out of the table, slots cleared; (records, slots, numbers forgotten)"},
    {"occupy", (PyCFunction)(void (*)(void))records_occupy, METH_FASTCALL,
     "occupy(keys, slots, ns, state, parent_of, insert, owner, other): record new keys, each after insert()"},
    {"mark_ready", (PyCFunction)records_mark_ready, METH_O, "mark_ready(keys): PENDING -> READY; their namespaces"},
    {"ready_run", (PyCFunction)(void (*)(void))records_ready_run, METH_FASTCALL,
     "ready_run(keys, ns, start, stop): the first position from start not READY for number ns"},
    {"pin_ready_run", (PyCFunction)(void (*)(void))records_pin_ready_run, METH_FASTCALL,
     "pin_ready_run(keys, ns): pin the leading run READY for number ns; how many"},
    {"unpin_many", (PyCFunction)records_unpin_many, METH_O, "unpin_many(keys): one pin off each"},
    {"slots_of", (PyCFunction)records_slots_of, METH_O, "slots_of(keys): the slots of resident keys"},
    {"pin_for_copy", (PyCFunction)records_pin_for_copy, METH_O,
     "pin_for_copy(keys): pin each resident key for a copy out; the record of each"},
    {"hit_many", (PyCFunction)(void (*)(void))records_hit_many, METH_FASTCALL,
     "hit_many(keys, policy_of): touch each in its owner's policy, count its hit; the counts"},
    {NULL, NULL},
};

static PyMemberDef records_members[] = {
    {"pinned", T_PYSSIZET, offsetof(Records, pinned), 0, "chunks with at least one pin"},
    {NULL},
};

static PyTypeObject RecordsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tiered_kv._keytable.SlotRecords",
    .tp_basicsize = sizeof(Records),
    .tp_dealloc = (destructor)records_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SlotRecords(slots, state, pins, hits, lease, namespace, parent, has_parent, children, names, "
              "held_by, other_owner, orphans, victim, tier, error, ready): a residency index's per-chunk steps over "
              "its arrays.",
    .tp_methods = records_methods,
    .tp_members = records_members,
    .tp_new = records_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tiered_kv._keytable",
    .m_doc = "Ordered tables of chunk keys that grow in O(1) steps.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__keytable(void)
{
    if (PyType_Ready(&IterType) < 0 || PyType_Ready(&KeyOrderType) < 0 || PyType_Ready(&KeyIntsType) < 0
        || PyType_Ready(&ListsType) < 0 || PyType_Ready(&ProtectionType) < 0 || PyType_Ready(&RecordsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "KeyOrder", (PyObject *)&KeyOrderType) < 0
        || PyModule_AddObjectRef(m, "KeyInts", (PyObject *)&KeyIntsType) < 0
        || PyModule_AddObjectRef(m, "PrefixLists", (PyObject *)&ListsType) < 0
        || PyModule_AddObjectRef(m, "Protection", (PyObject *)&ProtectionType) < 0
        || PyModule_AddObjectRef(m, "SlotRecords", (PyObject *)&RecordsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
