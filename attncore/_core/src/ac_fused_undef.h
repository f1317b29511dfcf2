/*
 * ac_fused_undef.h -- forget the per-instruction-set macros that
 * ac_fused_x86.h defines before each inclusion of ac_fused_impl.h.
 * Included once after each inclusion; not a standalone header.
 */
#undef AC_ISA
#undef AC_TGT
#undef VEC
#undef AC_W
#undef AC_P
#undef AC_KU
#undef AC_RU
#undef AC_CV
#undef VLOADN
#undef VSTOREN
#undef VGATHER
#undef VPACK
#undef VZERO
#undef VLOAD
#undef VSTORE
#undef VSET1
#undef VFMA
#undef VMAX
#undef VADD
#undef VSUB
#undef VMUL
#undef VEXP2
#undef VCAUSAL
#undef VZERO_IF_NINF
#undef VHIDE_FROM
#undef VTANH
#undef VIOTA
#undef VABS
#undef AC_BF16_PANEL
