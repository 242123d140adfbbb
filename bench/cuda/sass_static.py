#!/usr/bin/env python3
"""Static SASS opcode listing of sm_90a cubins, for a machine without cuobjdump / nvdisasm.

The development machine's CUDA toolkit has nvcc and ptxas but no disassembler, and the GPU
machine is not always lent. This lists each kernel of a cubin instruction by instruction as
its opcode mnemonic (no operands), its guard predicate and whether a branch goes backwards
(a loop's closing branch), so that a kernel change's effect on a loop's instruction count and
mix can be read before it runs. The mnemonic of an instruction is given by the low 12 bits of
its first 64-bit word (sm_90); the table below was read off cuobjdump listings of this
project's and DeepGEMM's kernels (111 opcodes, no two mnemonics sharing a code); an opcode not
in it prints as ?xxx. Static counts only: a loop body's instructions, not how often they run.

  nvcc ... -cubin -o k.cubin k.cu      (the build's compile line with -cubin for -c)
  bench/cuda/sass_static.py k.cubin [KERNEL_REGEX] [--histogram FROM_LINE TO_LINE]
"""
import re
import signal
import struct
import subprocess
import sys
from collections import Counter

OPCODES = {
    0x207: 'SEL', 0x208: 'FSEL', 0x209: 'FMNMX', 0x20c: 'ISETP', 0x210: 'IADD3', 0x211: 'LEA',
    0x212: 'LOP3', 0x220: 'FMUL', 0x221: 'FADD', 0x223: 'FFMA', 0x224: 'IMAD', 0x225: 'IMAD',
    0x227: 'IMAD', 0x246: 'VIADDMNMX', 0x248: 'VIMNMX', 0x287: 'USEL', 0x28c: 'UISETP',
    0x290: 'UIADD3', 0x291: 'ULEA', 0x292: 'ULOP3', 0x2a4: 'UIMAD', 0x2a5: 'UIMAD', 0x2ca: 'R2UR',
    0x305: 'F2I', 0x308: 'MUFU', 0x311: 'F2I', 0x312: 'I2F', 0x348: 'WARPSYNC', 0x387: 'STL',
    0x388: 'STS', 0x389: 'SHFL', 0x38c: 'ATOMS', 0x3ba: 'UBLKCP', 0x3c6: 'FENCE', 0x424: 'IMAD',
    0x589: 'SHFL', 0x5a7: 'SYNCS', 0x5b2: 'SYNCS', 0x5b4: 'UTMALDG', 0x802: 'MOV', 0x803: 'P2R',
    0x805: 'CS2R', 0x807: 'SEL', 0x80c: 'ISETP', 0x810: 'IADD3', 0x811: 'LEA', 0x812: 'LOP3',
    0x816: 'PRMT', 0x819: 'SHF', 0x81c: 'PLOP3', 0x824: 'IMAD', 0x825: 'IMAD', 0x827: 'IMAD',
    0x82e: 'ACQBULK', 0x82f: 'ELECT', 0x836: 'VIADD', 0x846: 'VIADDMNMX', 0x882: 'UMOV',
    0x887: 'USEL', 0x88c: 'UISETP', 0x890: 'UIADD3', 0x891: 'ULEA', 0x892: 'ULOP3',
    0x896: 'UPRMT', 0x899: 'USHF', 0x8a4: 'UIMAD', 0x8a5: 'UIMAD', 0x918: 'NOP', 0x919: 'S2R',
    0x91b: 'ENDCOLLECTIVE', 0x941: 'BSYNC', 0x944: 'CALL', 0x945: 'BSSY', 0x946: 'YIELD',
    0x947: 'BRA', 0x948: 'WARPSYNC', 0x94d: 'EXIT', 0x950: 'RET', 0x95d: 'NANOSLEEP',
    0x981: 'LDG', 0x983: 'LDL', 0x984: 'LDS', 0x986: 'STG', 0x988: 'STS', 0x989: 'SHFL',
    0x992: 'MEMBAR', 0x9a7: 'SYNCS', 0x9b9: 'UTMACCTL', 0x9c3: 'S2UR', 0x9c5: 'WARPGROUP',
    0x9c8: 'USETMAXREG', 0x9f3: 'QGMMA', 0xab9: 'ULDC', 0xb1d: 'BAR', 0xb82: 'LDC', 0xc07: 'SEL',
    0xc0c: 'ISETP', 0xc10: 'IADD3', 0xc11: 'LEA', 0xc12: 'LOP3', 0xc24: 'IMAD', 0xc25: 'IMAD',
    0xc36: 'VIADD', 0xc46: 'VIADDMNMX', 0xc48: 'VIMNMX', 0xc82: 'UMOV', 0xd06: 'I2F',
    0xd12: 'I2F', 0xe24: 'IMAD', 0xf89: 'SHFL', 0xf8c: 'ATOMS',
}


def text_sections(path):
    out = subprocess.run(['readelf', '-S', '-W', path], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        m = re.search(r'\] \.text\.(\S+)\s+PROGBITS\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)', line)
        if m:
            yield m.group(1), int(m.group(2), 16), int(m.group(3), 16)


def listing(path, name_regex='.'):
    data = open(path, 'rb').read()
    for name, offset, size in text_sections(path):
        if not re.search(name_regex, name):
            continue
        rows = []
        for addr in range(0, size, 16):
            w0, = struct.unpack_from('<Q', data, offset + addr)
            op = OPCODES.get(w0 & 0xfff, '?%03x' % (w0 & 0xfff))
            pred = (w0 >> 12) & 0xf
            guard = '' if pred == 7 else ('@!' if pred & 8 else '@') + (
                'PT' if pred & 7 == 7 else 'P%d' % (pred & 7))
            backward = op == 'BRA' and (w0 >> 63) & 1 == 1
            rows.append((addr, guard, op, backward))
        yield name, rows


def main():
    args = sys.argv[1:]
    if not args or args[0] in ('-h', '--help'):
        print(__doc__)
        return 0
    hist = None
    if '--histogram' in args:
        i = args.index('--histogram')
        hist = (int(args[i + 1]), int(args[i + 2]))
        del args[i:i + 3]
    path = args[0]
    regex = args[1] if len(args) > 1 else '.'
    for name, rows in listing(path, regex):
        print('== %s (%d instructions)' % (name, len(rows)))
        if hist:
            counts = Counter(op for _, _, op, _ in rows[hist[0]:hist[1] + 1])
            print(' '.join('%s:%d' % kv for kv in counts.most_common()))
            continue
        for n, (addr, guard, op, backward) in enumerate(rows):
            print('%5d %05x %-5s %s%s' % (n, addr, guard, op, '  <- backward' if backward else ''))
    return 0


if __name__ == '__main__':
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under head / sed
    sys.exit(main())
