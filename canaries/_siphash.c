/* SipHash-2-4 of one 64-bit message word per lane, compiled (canaries.siphash).
 *
 * siphash24_into(k0, k1, message, out) writes, for each i, SipHash-2-4 of the 8-byte
 * little-endian message[i] under the key k0.to_bytes(8, "little") + k1.to_bytes(8,
 * "little") into out[i]. message and out are C-contiguous buffers of native 64-bit
 * unsigned integers of the same length (numpy uint64 arrays); they may be the same
 * buffer. The tests compare it with the numpy version and the reference on random lanes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                         \
    do {                                                                                 \
        v0 += v1;                                                                        \
        v1 = ROTL(v1, 13);                                                               \
        v1 ^= v0;                                                                        \
        v0 = ROTL(v0, 32);                                                               \
        v2 += v3;                                                                        \
        v3 = ROTL(v3, 16);                                                               \
        v3 ^= v2;                                                                        \
        v0 += v3;                                                                        \
        v3 = ROTL(v3, 21);                                                               \
        v3 ^= v0;                                                                        \
        v2 += v1;                                                                        \
        v1 = ROTL(v1, 17);                                                               \
        v1 ^= v2;                                                                        \
        v2 = ROTL(v2, 32);                                                               \
    } while (0)

static uint64_t
siphash24_word(uint64_t k0, uint64_t k1, uint64_t m)
{
    uint64_t v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    const uint64_t last = (uint64_t)8 << 56; /* length 8, no leftover bytes */
    v3 ^= m;
    SIPROUND;
    SIPROUND;
    v0 ^= m;
    v3 ^= last;
    SIPROUND;
    SIPROUND;
    v0 ^= last;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

static int
words(Py_buffer *view, const char *name)
{
    if (view->itemsize != 8 || view->ndim != 1 ||
        (view->format != NULL && strcmp(view->format, "Q") != 0 &&
         strcmp(view->format, "L") != 0 && strcmp(view->format, "<Q") != 0 &&
         strcmp(view->format, "=Q") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-d buffer of uint64", name);
        return -1;
    }
    return 0;
}

static PyObject *
siphash24_into(PyObject *module, PyObject *args)
{
    unsigned long long k0, k1;
    PyObject *message_object, *out_object;
    if (!PyArg_ParseTuple(args, "KKOO:siphash24_into", &k0, &k1, &message_object, &out_object))
        return NULL;
    Py_buffer message, out;
    if (PyObject_GetBuffer(message_object, &message, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(out_object, &out,
                           PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&message);
        return NULL;
    }
    PyObject *result = NULL;
    if (words(&message, "message") < 0 || words(&out, "out") < 0)
        goto done;
    if (message.len != out.len) {
        PyErr_SetString(PyExc_ValueError, "message and out differ in length");
        goto done;
    }
    const uint64_t *in = (const uint64_t *)message.buf;
    uint64_t *hashes = (uint64_t *)out.buf;
    Py_ssize_t lanes = message.len / 8;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < lanes; i++)
        hashes[i] = siphash24_word(k0, k1, in[i]);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&message);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"siphash24_into", siphash24_into, METH_VARARGS,
     "siphash24_into(k0, k1, message, out): see canaries/_siphash.pyi."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "canaries._siphash",
    "SipHash-2-4 of 64-bit words, compiled (canaries.siphash).", -1, methods,
};

PyMODINIT_FUNC
PyInit__siphash(void)
{
    return PyModule_Create(&module_def);
}
