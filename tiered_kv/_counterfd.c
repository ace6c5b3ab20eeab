/* The 8-byte counters of Linux's eventfd and timerfd, read and written without giving up
 * the interpreter lock.
 *
 * os.read and os.write give up the lock around their system call. On the event loop's
 * thread that is a wait: a worker thread queued for the lock takes it, and the loop has
 * it back only once that worker, and any other queued before the loop, gives it up
 * again. A counter's read or write never blocks (the descriptors are non-blocking) and
 * takes a microsecond, so these keep the lock through it. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

#ifdef __linux__
#include <sys/eventfd.h>
#endif

/* eventfd(): a new non-blocking, close-on-exec eventfd, its counter at zero. */
static PyObject *
new_eventfd(PyObject *module, PyObject *unused)
{
#ifdef __linux__
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(fd);
#else
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

/* One read or write of the counter of the descriptor ``arg``, retried when a signal
 * interrupts it: its bytes (8), or -1 with errno set, or -2 with a Python exception set
 * (``arg`` is no descriptor number, or the call moved other than 8 bytes). */
static ssize_t
counter_io(PyObject *arg, int writing, uint64_t *value)
{
    int fd;
    if (!PyArg_Parse(arg, "i", &fd))
        return -2;
    ssize_t n;
    do
        n = writing ? write(fd, value, sizeof *value) : read(fd, value, sizeof *value);
    while (n < 0 && errno == EINTR);
    if (n >= 0 && n != sizeof *value) {
        PyErr_Format(PyExc_OSError, "a counter's %s moved %zd bytes of 8", writing ? "write" : "read", n);
        return -2;
    }
    return n;
}

/* signal(fd): add one to an eventfd's counter, which makes it readable. A counter at its
 * maximum (EAGAIN) is readable already. */
static PyObject *
signal_fd(PyObject *module, PyObject *arg)
{
    uint64_t one = 1;
    ssize_t n = counter_io(arg, 1, &one);
    if (n == -2 || (n < 0 && errno != EAGAIN))
        return n == -2 ? NULL : PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* take(fd): an eventfd's or timerfd's counter, set back to zero; 0 when it is zero
 * already (EAGAIN: a wake-up somebody else took). */
static PyObject *
take(PyObject *module, PyObject *arg)
{
    uint64_t count = 0;
    ssize_t n = counter_io(arg, 0, &count);
    if (n == -2)
        return NULL;
    if (n < 0 && errno == EAGAIN)
        return PyLong_FromLong(0);
    if (n < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromUnsignedLongLong(count);
}

static PyMethodDef methods[] = {
    {"eventfd", new_eventfd, METH_NOARGS, "eventfd(): a new non-blocking, close-on-exec eventfd"},
    {"signal", signal_fd, METH_O, "signal(fd): add one to an eventfd's counter"},
    {"take", take, METH_O, "take(fd): an eventfd's or timerfd's counter, reset; 0 if none"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef counterfd_module = {
    PyModuleDef_HEAD_INIT, "_counterfd", "eventfd and timerfd counters, kept under the interpreter lock.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__counterfd(void)
{
    return PyModule_Create(&counterfd_module);
}
