// The translation unit that owns the precompiled header (CMakeLists.txt, sublinear_pch): empty.
