"""The Python mirror of the C API against ``ce_runtime.h`` itself.

``python/cegen/_runtime.py`` repeats the header's enums, constants and structs for ctypes;
this test reads the header and fails on any value, name or field that drifts (a new enum
value, a renumbered one, a struct field added, moved or retyped), so the two are written
once in effect.
"""

from __future__ import annotations

import ctypes
import pathlib
import re
import unittest

from cegen import _runtime

HEADER = pathlib.Path(__file__).resolve().parents[2] / "runtime/include/ce/runtime/ce_runtime.h"

# C enum name -> (Python class, the prefix its values drop).
ENUMS = {
    "ce_status": (_runtime.Status, "CE_ERROR_", {"CE_OK": "OK"}),
    "ce_dtype": (_runtime.DType, "CE_DTYPE_", {}),
    "ce_device_type": (_runtime.Device, "CE_DEVICE_", {}),
    "ce_label_layout": (_runtime.LabelLayout, "CE_LABELS_", {}),
    "ce_label_policy": (_runtime.LabelPolicy, "CE_LABEL_POLICY_", {}),
}

# C field types -> the ctypes types the mirror must use (enums are C ints).
C_TYPES = {
    "void *": ctypes.c_void_p,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    # A descriptor the caller owns (ce_options.lse_low); a plan points it at its own.
    "const struct ce_tensor *": ctypes.c_void_p,
}


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def header_enums(text: str) -> dict:
    enums = {}
    for body, name in re.findall(r"typedef enum \w+ \{(.*?)\} (\w+);", text, flags=re.S):
        values = {}
        for item in body.split(","):
            item = item.strip()
            if item:
                key, value = (part.strip() for part in item.split("="))
                values[key] = int(value)
        enums[name] = values
    return enums


def header_structs(text: str) -> dict:
    structs = {}
    for body, name in re.findall(r"typedef struct \w+ \{(.*?)\} (\w+);", text, flags=re.S):
        fields = []
        for decl in body.split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            match = re.fullmatch(r"(.+?)\s*\b(\w+)(\[(\w+)\])?", decl)
            assert match, decl
            ctype, field, _, extent = match.groups()
            fields.append((field, ctype.strip(), extent))
        structs[name] = fields
    return structs


def header_defines(text: str) -> dict:
    return {name: int(value) for name, value in re.findall(r"#define (CE_\w+) (\d+)", text)}


class TestCApiMirror(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.text = _strip_comments(HEADER.read_text(encoding="utf-8"))

    def test_enums(self) -> None:
        enums = header_enums(self.text)
        self.assertEqual(set(enums), set(ENUMS), "an enum of ce_runtime.h has no Python mirror")
        for c_name, (py_class, prefix, renames) in ENUMS.items():
            with self.subTest(enum=c_name):
                mirrored = {name: value for name, value in vars(py_class).items()
                            if name.isupper() and isinstance(value, int)}
                expected = {renames.get(name, name[len(prefix):] if name.startswith(prefix) else name):
                            value for name, value in enums[c_name].items()}
                self.assertEqual(mirrored, expected)

    def test_defines(self) -> None:
        defines = header_defines(self.text)
        self.assertEqual(defines["CE_MAX_RANK"], _runtime.CE_MAX_RANK)
        self.assertEqual(defines["CE_RUNTIME_BUNDLE_VERSION"], _runtime.CE_RUNTIME_BUNDLE_VERSION)

    def test_structs(self) -> None:
        structs = header_structs(self.text)
        for c_name, py_struct in (("ce_tensor", _runtime.TensorDesc), ("ce_options", _runtime.Options)):
            with self.subTest(struct=c_name):
                fields = structs[c_name]
                self.assertEqual([name for name, *_ in py_struct._fields_], [name for name, *_ in fields])
                for (name, c_type, extent), (_, py_type) in zip(fields, py_struct._fields_):
                    want = C_TYPES.get(c_type, ctypes.c_int)  # enums are ints
                    if extent is not None:
                        want = want * header_defines(self.text)[extent]
                    self.assertEqual(ctypes.sizeof(py_type), ctypes.sizeof(want), f"{c_name}.{name}")
                    self.assertEqual(getattr(py_type, "_type_", py_type),
                                     getattr(want, "_type_", want), f"{c_name}.{name}")

    def test_logit_scale_softcap_and_outputs(self) -> None:
        # ce_options' last four fields (issue 17): logit_scale, a float, 1 after
        # ce_options_init (a zeroed struct would be refused: the scale must be > 0);
        # logit_softcap, a float, 0 (no softcap); then the entropy and argmax outputs
        # (bundle format 5), NULL.
        fields = header_structs(self.text)["ce_options"]
        self.assertEqual([f[:2] for f in fields[-4:]],
                         [("logit_scale", "float"), ("logit_softcap", "float"),
                          ("entropy", "const struct ce_tensor *"),
                          ("argmax", "const struct ce_tensor *")])
        self.assertEqual(_runtime.Options._fields_[-4], ("logit_scale", ctypes.c_float))
        self.assertEqual(_runtime.Options._fields_[-3], ("logit_softcap", ctypes.c_float))
        self.assertEqual([f[0] for f in _runtime.Options._fields_[-2:]], ["entropy", "argmax"])
        options = _runtime.get_runtime().default_options()
        self.assertEqual(options.logit_scale, 1.0)
        self.assertEqual(options.logit_softcap, 0.0)
        self.assertIsNone(options.entropy)
        self.assertIsNone(options.argmax)

    def test_parser_sees_every_enum_value(self) -> None:
        # The parser itself must not drop values (a guard for this test).
        enums = header_enums(self.text)
        self.assertEqual(enums["ce_status"]["CE_ERROR_BACKEND"], 6)
        self.assertEqual(len(enums["ce_dtype"]), 5)


if __name__ == "__main__":
    unittest.main()
