/* The nvme driver's write of a run of consecutive slots, without the interpreter lock.
 *
 * A slot is a 4 KiB header block and its payload (tiers/nvme_format.py): the header's
 * fields, the chunk key, an xxh3-128 checksum of the payload and an xxh3-64 checksum of
 * the fields and key. Packed in Python, a worker thread held the interpreter lock for a
 * few microseconds per chunk, and the event loop's thread, wanting it back, waited for
 * that thread and for every other worker queued for the lock before it. write_run()
 * packs the headers and checksums the payloads with the lock released, then writes the
 * run in one pwritev.
 *
 * The hashes are xxHash's own, from the xxhash package's extension module, which
 * exports XXH3_64bits and XXH3_128bits: bind() finds them (dlsym) and says whether it
 * did. Without them the driver packs in Python, as before. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

/* The header block's size, the longest key, and where the key starts: magic (8),
 * version (2), key length (2), reserved (4), slot (8), payload length (8), namespace
 * fingerprint (32), payload checksum (16). All little-endian but the checksum, which is
 * xxHash's canonical (big-endian) form. */
#define HEADER_BYTES 4096
#define MAX_KEY_BYTES 256
#define FIXED_BYTES 80
#define FINGERPRINT_BYTES 32
#define MAGIC_BYTES 8

typedef struct {
    uint64_t low64;
    uint64_t high64;
} hash128;

static uint64_t (*xxh3_64)(const void *, size_t);
static hash128 (*xxh3_128)(const void *, size_t);
static unsigned char magic[MAGIC_BYTES];
static uint16_t version;

static void
put_le(unsigned char *at, uint64_t value, int bytes)
{
    for (int i = 0; i < bytes; i++)
        at[i] = (unsigned char)(value >> (8 * i));
}

static void
put_be64(unsigned char *at, uint64_t value)
{
    for (int i = 0; i < 8; i++)
        at[i] = (unsigned char)(value >> (8 * (7 - i)));
}

/* bind(library, magic, version): find XXH3_64bits and XXH3_128bits in ``library`` (the
 * path of an already loaded module) and keep the format's magic and version; whether
 * both hashes were found. */
static PyObject *
bind(PyObject *module, PyObject *args)
{
    const char *path;
    Py_buffer magic_arg;
    int version_arg;
    if (!PyArg_ParseTuple(args, "sy*i", &path, &magic_arg, &version_arg))
        return NULL;
    if (magic_arg.len != MAGIC_BYTES || version_arg < 0 || version_arg > 0xFFFF) {
        PyBuffer_Release(&magic_arg);
        PyErr_SetString(PyExc_ValueError, "bind() takes an 8-byte magic and a 16-bit version");
        return NULL;
    }
    xxh3_64 = NULL;
    xxh3_128 = NULL;
    /* The module stays loaded (its package imported it): the handle is not closed. */
    void *library = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    uint64_t (*found_64)(const void *, size_t) = NULL;
    hash128 (*found_128)(const void *, size_t) = NULL;
    if (library != NULL) {
        found_64 = (uint64_t(*)(const void *, size_t))dlsym(library, "XXH3_64bits");
        found_128 = (hash128(*)(const void *, size_t))dlsym(library, "XXH3_128bits");
    }
    if (found_64 == NULL || found_128 == NULL) {
        PyBuffer_Release(&magic_arg);
        Py_RETURN_FALSE;
    }
    memcpy(magic, magic_arg.buf, MAGIC_BYTES);
    PyBuffer_Release(&magic_arg);
    version = (uint16_t)version_arg;
    xxh3_64 = found_64;
    xxh3_128 = found_128;
    Py_RETURN_TRUE;
}

/* The header of slot ``slot`` for ``payload`` and ``key`` into the HEADER_BYTES block at
 * ``at``, zeros after it (whatever an earlier run left there). */
static void
pack_header(unsigned char *at, uint64_t slot, const Py_buffer *payload, const char *key, size_t key_len,
            const unsigned char *fingerprint)
{
    hash128 sum = xxh3_128(payload->buf, (size_t)payload->len);
    memcpy(at, magic, MAGIC_BYTES);
    put_le(at + 8, version, 2);
    put_le(at + 10, key_len, 2);
    put_le(at + 12, 0, 4);
    put_le(at + 16, slot, 8);
    put_le(at + 24, (uint64_t)payload->len, 8);
    memcpy(at + 32, fingerprint, FINGERPRINT_BYTES);
    put_be64(at + 64, sum.high64);
    put_be64(at + 72, sum.low64);
    memcpy(at + FIXED_BYTES, key, key_len);
    put_le(at + FIXED_BYTES + key_len, xxh3_64(at, FIXED_BYTES + key_len), 8);
    /* The rest of the block: no byte of a longer key written here before. */
    memset(at + FIXED_BYTES + key_len + 8, 0, HEADER_BYTES - (FIXED_BYTES + key_len + 8));
}

/* write_run(fd, offset, headers, payloads, keys, first_slot, fingerprint, padding,
 * payload_room): write slots first_slot, first_slot + 1, ... (one per payload, with its
 * key) at ``offset`` of ``fd`` in one pwritev, their headers packed into ``headers``
 * (HEADER_BYTES each) and each payload but the last followed by zeros from ``padding``
 * up to ``payload_room``. Returns (bytes written, bytes asked); raises OSError. */
static PyObject *
write_run(PyObject *module, PyObject *args)
{
    int fd;
    long long offset, first_slot;
    Py_ssize_t payload_room;
    PyObject *payloads, *keys;
    Py_buffer headers, fingerprint, padding;
    if (xxh3_64 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "write_run() before bind() found xxHash");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "iLw*O!O!Ly*y*n", &fd, &offset, &headers, &PyList_Type, &payloads, &PyList_Type,
                          &keys, &first_slot, &fingerprint, &padding, &payload_room))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = PyList_GET_SIZE(payloads), got = 0;
    Py_buffer *views = NULL;
    PyObject **held = NULL; /* the keys, each a reference of this call's own */
    struct iovec *iov = NULL;
    if (n == 0 || n != PyList_GET_SIZE(keys) || n > IOV_MAX / 3 || headers.len < n * HEADER_BYTES ||
        fingerprint.len != FINGERPRINT_BYTES || padding.len < payload_room || first_slot < 0 || offset < 0) {
        PyErr_SetString(PyExc_ValueError, "write_run(): arguments that do not make a run of slots");
        goto out;
    }
    views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    held = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    iov = PyMem_Malloc(sizeof(struct iovec) * 3 * (size_t)n);
    if (views == NULL || held == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (; got < n; got++) {
        if (got >= PyList_GET_SIZE(keys) || got >= PyList_GET_SIZE(payloads)) {
            PyErr_SetString(PyExc_ValueError, "write_run(): the lists changed while it ran");
            goto out;
        }
        PyObject *key = PyList_GET_ITEM(keys, got);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) > MAX_KEY_BYTES) {
            PyErr_SetString(PyExc_ValueError, "write_run(): a key that is not bytes a header holds");
            goto out;
        }
        Py_INCREF(key);
        held[got] = key;
        if (PyObject_GetBuffer(PyList_GET_ITEM(payloads, got), &views[got], PyBUF_SIMPLE) < 0)
            goto out;
        if (views[got].len > payload_room) {
            got++;
            PyErr_SetString(PyExc_ValueError, "write_run(): a payload longer than a slot");
            goto out;
        }
    }
    unsigned char *block = headers.buf;
    const unsigned char *print = fingerprint.buf;
    size_t asked = 0;
    int parts = 0;
    ssize_t written;
    int error = 0;
    /* Without the lock, only what this call holds: its references to the keys (bytes do
     * not change), its buffers of the payloads, headers, fingerprint and padding. */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = held[i];
        unsigned char *at = block + i * HEADER_BYTES;
        pack_header(at, (uint64_t)first_slot + (uint64_t)i, &views[i], PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key),
                    print);
        iov[parts++] = (struct iovec){at, HEADER_BYTES};
        iov[parts++] = (struct iovec){views[i].buf, (size_t)views[i].len};
        asked += HEADER_BYTES + (size_t)views[i].len;
        if (i < n - 1 && views[i].len < payload_room) {
            iov[parts++] = (struct iovec){padding.buf, (size_t)(payload_room - views[i].len)};
            asked += (size_t)(payload_room - views[i].len);
        }
    }
    do /* as os.pwritev does (PEP 475) */
        written = pwritev(fd, iov, parts, (off_t)offset);
    while (written < 0 && errno == EINTR);
    if (written < 0)
        error = errno;
    Py_END_ALLOW_THREADS
    if (written < 0) {
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
        goto out;
    }
    result = Py_BuildValue("(nn)", (Py_ssize_t)written, (Py_ssize_t)asked);
out:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    for (Py_ssize_t i = 0; held != NULL && i < n; i++)
        Py_XDECREF(held[i]);
    PyMem_Free(held);
    PyMem_Free(views);
    PyMem_Free(iov);
    PyBuffer_Release(&headers);
    PyBuffer_Release(&fingerprint);
    PyBuffer_Release(&padding);
    return result;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(library, magic, version): whether xxHash's XXH3 functions were found"},
    {"write_run", write_run, METH_VARARGS,
     "write_run(fd, offset, headers, payloads, keys, first_slot, fingerprint, padding, payload_room)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef slotwrite_module = {
    PyModuleDef_HEAD_INIT, "_slotwrite", "An nvme run of slots packed and written without the GIL.", -1, methods,
};

PyMODINIT_FUNC
PyInit__slotwrite(void)
{
    return PyModule_Create(&slotwrite_module);
}
