//go:build linux

package testcluster

import "syscall"

// dieWithParent kills the replica when the test process dies, even by a
// signal that skips the test's cleanups.
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
