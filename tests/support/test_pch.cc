// Hosts the test programs' precompiled header (tests/CMakeLists.txt); the
// program itself does nothing and is never run.
int main() { return 0; }
