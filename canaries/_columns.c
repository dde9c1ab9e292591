/* Many small objects from columns, compiled (canaries.span, canaries.mint).
 *
 * A 1,048,576-token prompt holds ~10^5 canaries; making their texts and spans one Python
 * call at a time costs more than minting them. Both functions below give exactly what the
 * pure-Python code beside them gives (the tests compare them on random columns):
 *
 * - spell(digits, table, row, prefix) -> list[str]: for each row d of digits (a 2-d
 *   C-contiguous int64 buffer), prefix followed by the table's rows (of row bytes each)
 *   numbered d[0], d[1], ...: (prefix + b"".join(rows[d])).decode("ascii") with rows the
 *   table cut into rows, as canaries.mint.CanaryMinter.spell spells canaries. Non-ASCII
 *   bytes: ValueError; a digit outside the table's rows: IndexError.
 * - from_columns(type, fields, *columns) -> tuple: for each row i, an instance of type
 *   with field fields[f] = columns[f][i], made as canaries.records.records_from_columns
 *   makes it (object.__new__, then each slot's own __set__: see _records.h). The fields
 *   must be slots; every column a list or tuple as long as the first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_records.h"

static int
check_ascii(const unsigned char *data, Py_ssize_t size, const char *name)
{
    unsigned char high = 0;
    for (Py_ssize_t i = 0; i < size; i++)
        high |= data[i];
    if (high & 0x80) {
        PyErr_Format(PyExc_ValueError, "%s holds non-ASCII bytes", name);
        return -1;
    }
    return 0;
}

static PyObject *
spell(PyObject *module, PyObject *args)
{
    PyObject *digits_obj;
    Py_buffer table, prefix;
    Py_ssize_t row;
    if (!PyArg_ParseTuple(args, "Oy*ny*:spell", &digits_obj, &table, &row, &prefix))
        return NULL;
    Py_buffer digits;
    if (PyObject_GetBuffer(digits_obj, &digits, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&table);
        PyBuffer_Release(&prefix);
        return NULL;
    }
    PyObject *result = NULL;
    const char *format = digits.format ? digits.format : "B";
    if (digits.ndim != 2 || digits.itemsize != 8 ||
        (strcmp(format, "l") != 0 && strcmp(format, "q") != 0 && strcmp(format, "<q") != 0 &&
         strcmp(format, "=q") != 0 && strcmp(format, "<l") != 0 && strcmp(format, "=l") != 0)) {
        PyErr_SetString(PyExc_TypeError, "digits must be a 2-d C-contiguous int64 buffer");
        goto done;
    }
    if (row < 1 || table.len % row != 0) {
        PyErr_SetString(PyExc_ValueError, "row must be positive and divide the table");
        goto done;
    }
    if (check_ascii(table.buf, table.len, "table") < 0 ||
        check_ascii(prefix.buf, prefix.len, "prefix") < 0)
        goto done;
    Py_ssize_t count = digits.shape[0], per_row = digits.shape[1], num_rows = table.len / row;
    Py_ssize_t width = prefix.len + per_row * row;
    const int64_t *cells = digits.buf;
    for (Py_ssize_t i = 0; i < count * per_row; i++) {
        if (cells[i] < 0 || cells[i] >= num_rows) {
            PyErr_Format(PyExc_IndexError, "digit %lld outside the table's %zd rows",
                         (long long)cells[i], num_rows);
            goto done;
        }
    }
    result = PyList_New(count);
    if (result == NULL)
        goto done;
    const char *rows = table.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *text = PyUnicode_New(width, 127);
        if (text == NULL) {
            Py_CLEAR(result); /* unfilled items are NULL: list_dealloc skips them */
            goto done;
        }
        char *out = PyUnicode_DATA(text);
        memcpy(out, prefix.buf, prefix.len);
        out += prefix.len;
        for (Py_ssize_t w = 0; w < per_row; w++, out += row)
            memcpy(out, rows + cells[i * per_row + w] * row, row);
        PyList_SET_ITEM(result, i, text);
    }
done:
    PyBuffer_Release(&digits);
    PyBuffer_Release(&table);
    PyBuffer_Release(&prefix);
    return result;
}

static PyObject *
from_columns(PyObject *module, PyObject *args)
{
    Py_ssize_t num_args = PyTuple_GET_SIZE(args);
    if (num_args < 2 || !PyTuple_Check(PyTuple_GET_ITEM(args, 1))) {
        PyErr_SetString(PyExc_TypeError, "from_columns(type, fields: tuple, *columns)");
        return NULL;
    }
    PyObject *fields = PyTuple_GET_ITEM(args, 1);
    Py_ssize_t num_fields = PyTuple_GET_SIZE(fields);
    if (num_args - 2 != num_fields) {
        PyErr_SetString(PyExc_ValueError, "one column for each field");
        return NULL;
    }
    RecordMaker maker;
    if (record_maker_init(&maker, PyTuple_GET_ITEM(args, 0), PySequence_Fast_ITEMS(fields),
                          num_fields) < 0)
        return NULL;
    PyObject **columns[RECORD_MAX_FIELDS];
    Py_ssize_t count = 0;
    for (Py_ssize_t f = 0; f < num_fields; f++) {
        PyObject *column = PyTuple_GET_ITEM(args, 2 + f);
        if (!PyList_Check(column) && !PyTuple_Check(column)) {
            PyErr_SetString(PyExc_TypeError, "every column must be a list or a tuple");
            record_maker_clear(&maker);
            return NULL;
        }
        Py_ssize_t size = PySequence_Fast_GET_SIZE(column);
        if (f == 0)
            count = size;
        else if (size != count) {
            PyErr_SetString(PyExc_ValueError, "columns of different lengths");
            record_maker_clear(&maker);
            return NULL;
        }
        columns[f] = PySequence_Fast_ITEMS(column);
    }
    /* From here no Python code runs (slots only, and the collector paused: no
     * finalizer), so the columns' item arrays stay as they are; the pause also spares
     * this burst of new objects the collections it would trigger. */
    int was_enabled = PyGC_Disable();
    PyObject *result = PyTuple_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        PyObject *values[RECORD_MAX_FIELDS];
        for (Py_ssize_t f = 0; f < num_fields; f++)
            values[f] = columns[f][i];
        PyObject *item = record_make(&maker, values);
        if (item == NULL)
            Py_CLEAR(result); /* unfilled items are NULL: tupledealloc skips them */
        else
            PyTuple_SET_ITEM(result, i, item);
    }
    if (was_enabled)
        PyGC_Enable();
    record_maker_clear(&maker);
    return result;
}

static PyMethodDef methods[] = {
    {"spell", spell, METH_VARARGS,
     "spell(digits, table, row, prefix) -> list[str]: see canaries/_columns.c."},
    {"from_columns", from_columns, METH_VARARGS,
     "from_columns(type, fields, *columns) -> tuple: see canaries/_columns.c."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "canaries._columns",
    "Many small objects from columns, compiled (canaries.span, canaries.mint).", -1, methods,
};

PyMODINIT_FUNC
PyInit__columns(void)
{
    return PyModule_Create(&module_def);
}
