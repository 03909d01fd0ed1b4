// 8 float lanes emulated one float at a time, for the generic builds of the quantized matmuls
// (qmatmul_generic.cpp, qdot_generic.cpp): each operation as its AVX2 instruction computes it, in
// the same order (those files are built with -ffp-contract=off: std::fma is the only fused one),
// so the same bits. Included inside the namespace that uses them (no include guard: each such
// namespace gets its own copy).
struct V {
  float l[8];
};
inline V vzero() { return V{}; }
inline V vload(const float* p) {
  V v;
  for (int i = 0; i < 8; ++i)
    v.l[i] = p[i];
  return v;
}
inline void vstore(float* p, const V& v) {
  for (int i = 0; i < 8; ++i)
    p[i] = v.l[i];
}
inline V vset1(float f) {
  V v;
  for (int i = 0; i < 8; ++i)
    v.l[i] = f;
  return v;
}
inline V vmul(V a, const V& b) {
  for (int i = 0; i < 8; ++i)
    a.l[i] *= b.l[i];
  return a;
}
inline V vadd(V a, const V& b) {
  for (int i = 0; i < 8; ++i)
    a.l[i] += b.l[i];
  return a;
}
inline V vfma(const V& a, const V& b, V c) {
  for (int i = 0; i < 8; ++i)
    c.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
  return c;
}
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): rowdot's hsum.
inline float vhsum(const V& v) {
  const float* l = v.l;
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
